"""`fagen build | list | show` end to end (NVRTC, no GPU)."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from fagen.cli import main, make_parser
from fagen.sass.listing import find_cuobjdump
from fagen.spec import Spec


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


def test_build_for_sm_90a_without_a_gpu(tmp_path, capsys):
    """--arch sm_90a (the Hopper family's arch-specific target) builds today's mma.sync kernels on a
    CPU-only machine: its own registers and spills beside sm_90's, and the same source."""
    out = tmp_path / "hopper"
    assert main(["build", "--d", "64", "--causal", "--arch", "sm_90,sm_90a", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "for sm_90, sm_90a (from --arch" in printed
    assert any(line.split()[:2] == ["fa2_d64_causal_fp16_fwd", "sm_90a"] for line in printed.splitlines())
    manifest = json.loads((out / "fa2_d64_causal_fp16.json").read_text())
    assert list(manifest["resources"]) == ["sm_90", "sm_90a"]
    for name in ("fa2_d64_causal_fp16_fwd", "fa2_d64_causal_fp16_bwd"):
        report = manifest["resources"]["sm_90a"][name]
        assert report["arch"] == "sm_90a" and report["registers"] > 0
        assert report["spill_store_bytes"] == report["spill_load_bytes"] == 0
    assert main(["show", "fa2_d64_causal_fp16", "--dir", str(out), "--resources"]) == 0
    assert "sm_90a" in capsys.readouterr().out


@pytest.fixture(scope="module")
def sm90_cache(tmp_path_factory):
    """One cache for the sm90 family's command tests: the build compiles fa2_d64_causal_fp16_sm90 for
    sm_90a (seconds of NVRTC) and `fagen sass` disassembles the same cubin."""
    return tmp_path_factory.mktemp("sm90_cache")


def test_build_the_sm90_family_for_sm_90a(tmp_path, capsys, sm90_cache, monkeypatch):
    """--arch-family sm90 builds the wgmma/TMA forward (beside the sm80 backward) for sm_90a by
    default; its op module runs on the CPU's emulator; another arch is refused by name."""
    from fagen.spec_flags import build_command

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(sm90_cache))
    out = tmp_path / "sm90"
    assert main(["build", "--d", "64", "--causal", "--arch-family", "sm90", "--out", str(out)]) == 0
    assert "for sm_90a (the sm90 family's arch-specific target" in capsys.readouterr().out
    manifest = json.loads((out / "fa2_d64_causal_fp16_sm90.json").read_text())
    assert manifest["spec"]["arch_family"] == "sm90" and list(manifest["resources"]) == ["sm_90a"]
    report = manifest["resources"]["sm_90a"]["fa2_d64_causal_fp16_sm90_fwd"]
    assert report["spill_store_bytes"] == 0 and report["registers"] <= 168
    assert "hopper_fwd" in (out / "fa2_d64_causal_fp16_sm90.cu").read_text()
    assert build_command(Spec.from_name("fa2_d64_causal_fp16_sm90")).endswith("--causal --arch-family sm90")
    assert main(["build", "--d", "64", "--arch-family", "sm90", "--arch", "sm_80", "--out", str(out)]) == 2
    assert "--arch sm_80: the sm90 arch family compiles for sm_90a only" in capsys.readouterr().err


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")
def test_sass_compiles_the_sm90_family_for_sm_90a_by_default(sm90_cache, monkeypatch, capsys):
    """`fagen sass --arch-family sm90` without --arch compiles for sm_90a, as `fagen build` does (it
    compiled for sm_90, whose ptxas refuses wgmma, TMA and setmaxnreg with a page of errors)."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(sm90_cache))
    assert main(["sass", "--d", "64", "--causal", "--arch-family", "sm90"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("fa2_d64_causal_fp16_sm90 on sm_90a:")
    assert "HGMMA" in captured.out and "ptxas" not in captured.err and "error" not in captured.err.lower()


def test_a_failed_compile_is_a_message_and_exit_1(tmp_path, capsys, monkeypatch):
    """A CompileError (NVRTC's refusal, or a wgmma pipeline ptxas serialises) reaches the user as
    `fagen: ...` and exit status 1, not as a traceback."""
    from fagen import cache_files
    from fagen.kernels import compile as compile_module

    def refuse(code, arch, filename="kernel.cu"):
        raise compile_module.CompileError("NVRTC says no (a test's refusal)")

    monkeypatch.setattr(compile_module, "nvrtc_compile", refuse)
    monkeypatch.setattr(compile_module, "_memory_cache", {})          # no earlier build's cubins:
    monkeypatch.setenv(cache_files.CACHE_ENV, str(tmp_path / "cache"))   # NVRTC must be asked
    out = tmp_path / "refused"
    assert main(["build", "--d", "64", "--arch", "sm_80", "--out", str(out)]) == 1
    assert "fagen: NVRTC says no (a test's refusal)" in capsys.readouterr().err


def test_build_with_a_narrower_value_head_dim(tmp_path, capsys):
    """--dv: V's head dim below --d names the spec d32v16 and reaches the kernels' constants;
    one wider than --d exits 2 with the spec's reason."""
    from fagen.spec_flags import build_command

    out = tmp_path / "dv"
    assert main(["build", "--d", "32", "--dv", "16", "--causal", "--arch", "sm_90", "--out", str(out)]) == 0
    manifest = json.loads((out / "fa2_d32v16_causal_fp16.json").read_text())
    assert manifest["spec"]["head_dim"] == 32 and manifest["spec"]["head_dim_v"] == 16
    assert "constexpr int kHeadDimV = 16;" in (out / "fa2_d32v16_causal_fp16.cu").read_text()
    assert build_command(Spec.from_name("fa2_d32v16_causal_fp16")).startswith("fagen build --d 32 --dv 16 --causal")
    capsys.readouterr()
    assert main(["build", "--d", "32", "--dv", "64", "--arch", "sm_90", "--out", str(out)]) == 2
    assert "head_dim_v=64 is larger than head_dim=32" in capsys.readouterr().err


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
    assert result.returncode == 0 and "no fagen specs" in result.stdout


def test_verify_proves_every_identity_and_for_a_spec_a_subset(capsys):
    assert main(["verify"]) == 0
    everything = capsys.readouterr().out
    assert "softmax" in everything.lower() and "FAILED" not in everything
    assert main(["verify", "--spec", "fa1_d64_fp16"]) == 0
    subset = capsys.readouterr().out
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
    from fagen.version import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"fagen {__version__}"
    result = subprocess.run([sys.executable, "-m", "fagen", "list", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0 and "no fagen specs" in result.stdout


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
    (["build", "--default-set", "--d", "64"], "--default-set builds a fixed set of specs; it takes no --d"),
    (["build", "--default-set", "--causal", "--bwd-stages", "1"], "takes no --causal, --bwd-stages"),
    (["build", "--causal"], "--d (head dim) is required"),
    (["verify", "--causal"], "--causal describes a spec, which also needs --d"),
    (["verify", "--causal", "--softcap"], "--causal, --softcap describe a spec, which also needs --d"),
    (["verify", "--spec", "fa2_d64_fp16", "--d", "128"],
     "--spec fa2_d64_fp16 names the whole spec; it takes no --d"),
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
    from fagen.spec_flags import build_command

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


# -- every flag of every command ---------------------------------------------------------------
# Each option `--help` lists either works or exits 2 with a message. The options come from the
# parser itself, so a new one is covered (and needs a value below) the day it is added.

SUITE_CACHE = os.environ.get("FAGEN_CACHE_DIR")   # before the autouse fixture's per-test one
D = 16                                            # the smallest head dim every command takes
TABLE = Spec(D)                                   # tile options take the table's own values: no new compile
VALUES = {   # a cheap valid value per option that takes one, by its first spelling
    "--d": [str(D)], "--dtype": ["fp16"], "--version": ["2"], "--window": ["8", "0"],
    "--block-m": [str(TABLE.block_m)], "--block-n": [str(TABLE.block_n)], "--num-warps": [str(TABLE.num_warps)],
    "--num-stages": [str(TABLE.num_stages)], "--bwd-stages": [str(TABLE.bwd_stages)],
    "--bwd-block-n": [str(TABLE.bwd_block_n)], "--arch": ["sm_90"], "--out": ["{tmp}/out"],
    "--dir": ["{built}"], "--json": ["{tmp}/counters.json"], "--spec": [f"fa2_d{D}_fp16"],
    "--seqlen": ["16"], "--seqlen-k": ["24"], "--batch": ["2"], "--heads": ["2"], "--kv-heads": ["1"],
    "--workers": ["1"], "--dv": [str(D)], "--cubin": ["{tmp}/peer.cubin"], "--arch-family": ["sm80"],
    "--device": ["cuda"], "--family": ["sm80"], "--template": ["sm80.d64"], "--budget": ["5"],
    "--case-timeout": ["5"],
}
BASE = {   # what each command runs with, besides the option under test
    "": [], "build": ["--d", str(D), "--arch", "sm_90", "--out", "{tmp}/out"], "list": [], "bench": [],
    "show": [f"fa2_d{D}_fp16", "--dir", "{built}"], "verify": ["--d", str(D)], "tune": ["--d", str(D)],
    "profile": ["--d", str(D), "--seqlen", "16"], "sass": ["--d", str(D)], "selftest": [],
}
ALONE = {("tune", "--show"), ("tune", "--clear"), ("verify", "--spec")}   # options that take no base


def _commands():
    parser = make_parser()
    yield "", parser
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    yield from sub.choices.items()


FLAG_CASES = [(command, action.option_strings[0], flag, action.nargs == 0) for command, parser in _commands()
              for action in parser._actions for flag in action.option_strings]


def _refusal(command: str, first: str) -> str | None:
    """The message of an option that exits 2 here (None: it works)."""
    if first in ("-h", "--version") and (command == "" or first == "-h"):
        return None
    if (command, first) == ("build", "--default-set"):
        return "--default-set builds a fixed set of specs; it takes no --d"
    if command == "tune" and first in ("--window", "--softcap", "--alibi", "--sinks"):
        return "which tuning does not cover yet"
    if command == "tune" and first not in ("--show", "--clear"):
        return "tuning times kernels on a CUDA GPU, and none is visible"
    if command == "selftest":   # its CUDA device, here without one (--device cpu would run the emulator)
        return "no CUDA GPU is visible"
    if command == "sass" and find_cuobjdump() is None:
        return "fagen sass reads machine code with cuobjdump"
    if (command, first) == ("sass", "--cubin"):   # the base names a spec (--d): a cubin takes none
        return "--cubin reads a cubin built elsewhere; it takes no spec (--d)"
    return None


@pytest.fixture(scope="module")
def flag_cache(tmp_path_factory):
    """One cache for the module's commands, so that cases which name the same variant compile it once."""
    return tmp_path_factory.mktemp("flag_cache")


@pytest.fixture(scope="module")
def built(flag_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAGEN_CACHE_DIR", str(flag_cache))
        assert main(["build", "--d", str(D), "--arch", "sm_90", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def remembered():
    """What the module's cases have proven and disassembled: most cases ask for the same again."""
    return {"proofs": {}, "sass": {}}


def _remember_proofs(run, proven: dict):
    """identities.run, proving each identity once per module."""
    def remembered_run(identities=None, spec=None):
        from fagen import identities as package

        chosen = identities if identities is not None else (
            package.IDENTITIES if spec is None else package.for_spec(spec))
        proven.update((result.name, result) for result in run([i for i in chosen if i.name not in proven]))
        return [proven[i.name] for i in chosen]
    return remembered_run


def _remember_sass(report_for_spec, reports: dict):
    """sass.report.report_for_spec, disassembling each (variant, arch) once per module."""
    def remembered_report(spec, arch):
        if (spec.name, arch) not in reports:
            reports[spec.name, arch] = report_for_spec(spec, arch)
        return reports[spec.name, arch]
    return remembered_report


def _use_cache(monkeypatch, command: str, flag_cache) -> None:
    """The emulator's runtime takes half a minute to build once per cache, so profile shares the
    suite's cache (test_profiling's); the other commands share the module's."""
    if command != "profile":
        monkeypatch.setenv("FAGEN_CACHE_DIR", str(flag_cache))
    elif SUITE_CACHE is None:
        monkeypatch.delenv("FAGEN_CACHE_DIR")
    else:
        monkeypatch.setenv("FAGEN_CACHE_DIR", SUITE_CACHE)


@pytest.mark.parametrize("command, first, flag, takes_no_value", FLAG_CASES,
                         ids=[f"{case[0] or 'fagen'} {case[2]}" for case in FLAG_CASES])
def test_every_flag_of_every_command_works_or_exits_2(command, first, flag, takes_no_value, flag_cache, built,
                                                      remembered, tmp_path, monkeypatch, capsys):
    from fagen import identities
    from fagen.sass import report

    assert takes_no_value or first in VALUES, f"give {first} a cheap valid value in VALUES"
    values = [] if takes_no_value else VALUES[first]
    _use_cache(monkeypatch, command, flag_cache)
    monkeypatch.setattr(identities, "run", _remember_proofs(identities.run, remembered["proofs"]))
    monkeypatch.setattr(report, "report_for_spec", _remember_sass(report.report_for_spec, remembered["sass"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # tune's answer without a GPU, everywhere
    base = [] if (command, first) in ALONE else BASE[command]
    argv = [arg.format(tmp=tmp_path, built=built) for arg in [command, *base, flag, *values] if arg]
    try:
        code = main(argv)
    except SystemExit as exit_info:   # --help, --version
        code = exit_info.code
    refusal, err = _refusal(command, first), capsys.readouterr().err
    if refusal:
        assert code == 2 and refusal in err, (argv, code, err)
    else:
        assert code == 0, (argv, code, err)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


# The commands that take both an arch family and an arch (verify, profile and tune take no --arch), each
# naming the sm90 family its way: by --arch-family, or (fagen sass) by a spec's name.
FAMILY_AND_ARCH = [command for command, parser in _commands() if {"--arch", "--arch-family"} <= _options(parser)]
SM90_SPEC_ARGS = [(command, [command, "--d", "64", "--arch-family", "sm90"]) for command in FAMILY_AND_ARCH]
SM90_SPEC_ARGS += [("sass NAME", ["sass", "fa2_d64_fp16_sm90"])]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("command, spec_args", SM90_SPEC_ARGS, ids=[case[0] for case in SM90_SPEC_ARGS])
def test_an_arch_the_sm90_family_cannot_use_is_refused_in_one_line(command, spec_args, arch, tmp_path, capsys):
    """An --arch the sm90 family cannot use (it compiles for sm_90a only) is refused before anything is
    compiled or written, in one line naming both, exit 2 (plain sm_90 went on to ptxas's page of errors)."""
    assert {"build", "sass"} <= set(FAMILY_AND_ARCH)
    out = tmp_path / "out"
    assert main([*spec_args, "--arch", arch] + (["--out", str(out)] if command == "build" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fagen: --arch {arch}: the sm90 arch family compiles for sm_90a only ("), err
    assert err.count("\n") == 1 and "Traceback" not in err and not out.exists()
