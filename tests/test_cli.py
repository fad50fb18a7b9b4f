"""`fagen build | list | show` end to end (NVRTC, no GPU)."""

import json
import subprocess
import sys

import pytest

from fagen.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_build_writes_source_module_and_manifest(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["build", "--d", "64", "--causal", "--arch", "sm_80,sm_90", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[1/1] fa2_d64_causal_fp16" in printed
    assert "fa2_d64_causal_fp16_fwd" in printed and "sm_90" in printed
    names = sorted(p.name for p in out.iterdir())
    assert names == ["__init__.py", "fa2_d64_causal_fp16.cu", "fa2_d64_causal_fp16.json",
                     "fa2_d64_causal_fp16.py"]
    manifest = json.loads((out / "fa2_d64_causal_fp16.json").read_text())
    assert manifest["spec"]["mask"] == "causal"
    assert set(manifest["resources"]) == {"sm_80", "sm_90"}
    for arch in ("sm_80", "sm_90"):
        report = manifest["resources"][arch]["fa2_d64_causal_fp16_fwd"]
        assert report["registers"] > 0 and report["spill_store_bytes"] == 0


def test_build_several_variants_shows_progress(tmp_path, capsys):
    out = tmp_path / "y"
    assert main(["build", "--d", "32", "64", "--dtype", "fp16", "bf16", "--arch", "sm_80",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for i in range(1, 5):
        assert f"[{i}/4]" in printed
    assert len(list(out.glob("*.cu"))) == 4


def test_build_for_a_99kb_part_fits_the_backward(tmp_path, capsys):
    """One source serves every arch named; with sm_86 among them the backward takes
    one Q/dO stage (its name says so) unless --bwd-stages is given."""
    out = tmp_path / "rtx"
    assert main(["build", "--d", "128", "--block-n", "32", "--arch", "sm_86", "--out", str(out)]) == 0
    manifest = json.loads((out / "fa2_d128_fp16_m128n32w8s2_bwd1.json").read_text())
    assert manifest["spec"]["bwd_stages"] == 1
    bwd = next(k for k in manifest["kernels"] if k["name"].endswith("_bwd"))
    assert bwd["dynamic_shared_bytes"] <= 101376
    capsys.readouterr()
    assert main(["build", "--d", "128", "--block-n", "32", "--bwd-stages", "2", "--arch", "sm_90",
                 "--out", str(out)]) == 0
    assert (out / "fa2_d128_fp16_m128n32w8s2.json").exists()


def test_list_and_show(tmp_path, capsys):
    out = tmp_path / "z"
    main(["build", "--d", "128", "--dtype", "bf16", "--version", "1", "--arch", "sm_80", "--out", str(out)])
    capsys.readouterr()
    assert main(["list", str(out)]) == 0
    assert "fa1_d128_bf16" in capsys.readouterr().out
    assert main(["show", "fa1_d128_bf16", "--dir", str(out)]) == 0
    assert "fagen generated kernel source: fa1_d128_bf16" in capsys.readouterr().out
    assert main(["show", "fa1_d128_bf16", "--dir", str(out), "--resources"]) == 0
    table = capsys.readouterr().out
    assert "regs" in table and "fa1_d128_bf16_fwd" in table and "sm_80" in table
    assert main(["show", "nope", "--dir", str(out)]) == 2


def test_bad_spec_is_a_clear_error(tmp_path, capsys):
    assert main(["build", "--d", "60", "--arch", "sm_80", "--out", str(tmp_path / "w")]) == 2
    assert "head_dim must be a positive multiple of 8" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
    assert main(["build", "--d", "64", "--arch", "sm_70", "--out", str(tmp_path / "w")]) == 2
    assert "unknown arch 'sm_70'" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fagen.cli", "list", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "no fagen variants" in result.stdout


def test_verify_proves_every_identity(capsys):
    assert main(["verify"]) == 0
    table = capsys.readouterr().out
    assert "softmax" in table.lower() and "FAILED" not in table


def test_verify_for_a_spec_checks_a_subset(capsys):
    assert main(["verify", "--spec", "fa1_d64_fp16"]) == 0
    subset = capsys.readouterr().out
    main(["verify"])
    everything = capsys.readouterr().out
    assert len(subset.splitlines()) < len(everything.splitlines())


def test_verify_exits_1_on_a_failing_identity(monkeypatch, capsys):
    from fagen import identities

    wrong = identities.Identity(name="deliberately wrong", shapes="N=1", check=lambda: False,
                                relied_on_by=lambda spec: True)
    monkeypatch.setattr(identities, "IDENTITIES", [*identities.IDENTITIES, wrong])
    assert main(["verify"]) == 1
    assert "deliberately wrong" in capsys.readouterr().out
