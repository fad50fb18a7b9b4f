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
    """One source serves every arch named; with sm_86 among them the backward takes 64-key
    blocks and one Q/dO stage (its name says so) unless --bwd-stages or --bwd-block-n is given."""
    out = tmp_path / "rtx"
    assert main(["build", "--d", "128", "--block-n", "32", "--arch", "sm_86", "--out", str(out)]) == 0
    manifest = json.loads((out / "fa2_d128_fp16_m128n32w8s2_bwd1_bwdn64.json").read_text())
    assert manifest["spec"]["bwd_stages"] == 1 and manifest["spec"]["bwd_block_n"] == 64
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


# -- first contact -------------------------------------------------------------------------------

def test_version_and_python_dash_m(tmp_path, capsys):
    from fagen import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"fagen {__version__}"
    result = subprocess.run([sys.executable, "-m", "fagen", "list", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0 and "no fagen variants" in result.stdout


def test_every_option_and_positional_has_help():
    import argparse

    from fagen.cli import make_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction):
                yield path, action

    missing = [(path, action.dest) for path, action in walk(make_parser(), "fagen") if not action.help]
    assert not missing


def test_bench_help_names_the_gpu_check(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "gpu-check" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["build", "--default-set", "--d", "64"], "--default-set builds a fixed set of variants; it takes no --d"),
    (["build", "--default-set", "--causal", "--bwd-stages", "1"], "takes no --causal, --bwd-stages"),
    (["build", "--causal"], "--d (head dim) is required"),
    (["verify", "--causal"], "--causal describe a variant, which also needs --d"),
    (["verify", "--spec", "fa2_d64_fp16", "--d", "128"],
     "--spec fa2_d64_fp16 names the whole variant; it takes no --d"),
    (["tune", "--show", "--d", "64"], "--show and --clear take no tuning options, got --d"),
])
def test_conflicting_or_ignored_options_are_errors(argv, message, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "build" else [])]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_list_of_a_missing_directory_fails(tmp_path, capsys):
    assert main(["list", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_show_of_a_spec_not_built_gives_the_build_command(tmp_path, capsys):
    assert main(["show", "fa2_d64_causal_bf16", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"fagen build --d 64 --dtype bf16 --causal --out {tmp_path}" in err
    assert main(["show", "not_a_spec", "--dir", str(tmp_path)]) == 2
    assert "not a spec name" in capsys.readouterr().err


def test_the_build_command_rebuilds_the_same_spec(tmp_path, capsys):
    from fagen.spec import Spec
    from fagen.variant_flags import build_command

    spec = Spec(96, dtype="bf16", version=1, mask="causal", key_padding=True, dropout=True, deterministic=True,
                block_m=64, block_n=32, num_warps=4, num_stages=1, bwd_stages=1)
    argv = build_command(spec, tmp_path / "x").split()[1:]
    assert main([*argv, "--arch", "sm_80"]) == 0
    assert (tmp_path / "x" / f"{spec.name}.cu").exists()


def test_build_logs_what_it_compiles(tmp_path, capsys):
    assert main(["build", "--d", "40", "--arch", "sm_80", "--out", str(tmp_path / "l")]) == 0
    captured = capsys.readouterr()
    assert "fagen: compiling fa2_d40_fp16 for sm_80 with NVRTC" in captured.err
    assert "NVRTC" in captured.out.splitlines()[0]   # the summary names the compiler and the archs' origin
