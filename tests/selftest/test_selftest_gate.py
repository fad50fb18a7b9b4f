"""The gate (fagen.selftest.gate) on a stand-in compute-capability 9.0 device: the CPU, whose
emulator runs both families, given a GPU's facts (`gate.STAND_INS`). Its first eligible call runs
the self-test (planted cases: tests/support/selftest_planted.py) in a child; the kernel loads are
recorded and stubbed (fagen.kernel_record), so no kernel is built.

  - after a passing self-test the stand-in takes the sm90 family by default, after a failing one
    sm80 (with a warning naming the template, the log and `fagen selftest --verbose`); where only
    sm90.backward failed, the sm90 forward with the sm80 family's backward (Spec.sm80_backward),
    whose gradients the emulator checks;
  - a failed sm80 template raises at first use (a generated op module's too), and
    FAGEN_SELFTEST=0 is the way past it;
  - the verdict is read back from disk, and a new key (here: the family's sources) tests again;
  - FAGEN_ARCH_FAMILY forces a family and a tuned spec keeps its own;
  - a file lock makes two processes' concurrent first calls run one self-test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fagen
from fagen.kernel_record import identity_for, record
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.selftest import gate, templates_of
from fagen.selftest.gate import DeviceFacts, FirstUse, SelftestFailure
from fagen.selftest.verdicts import selftest_dir
from fagen.spec import Spec

from kernel_cases import Shape, run_and_check
from selftest_planted import CHILD_ENV, PAUSE_ENV, RUNS_ENV, SUPPORT

STAND_IN = DeviceFacts((9, 0), "Stand-in H100", "580.0", "12.9", "12.9", "cpu")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The CPU as a 9.0 GPU with its own cache directory; `use(table)` plants the cases its first
    call will run. Yields the file each passing case appends a line to."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("FAGEN_ARCH_FAMILY", "FAGEN_SELFTEST"):
        monkeypatch.delenv(name, raising=False)
    runs = tmp_path / "runs"
    monkeypatch.setenv(RUNS_ENV, str(runs))
    monkeypatch.setitem(gate.STAND_INS, "cpu", STAND_IN)
    gate.forget()
    yield runs
    gate.forget()


def use(monkeypatch, table: str) -> None:
    monkeypatch.setattr(gate, "FIRST_USE", FirstUse(cases=f"selftest_planted:{table}", env=CHILD_ENV,
                                                    case_timeout_s=60.0, budget_s=180.0))


def runs_of(runs) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def spec_of_call(call) -> Spec:
    """The spec of the first kernel `call` loads (recorded, not run)."""
    recorded = record([("call", call)], identity_for("sm_90"))
    assert recorded.specs, recorded.errors
    return recorded.specs[0]


def family_of_call(call) -> str:
    return spec_of_call(call).arch_family


def fagen_warnings(warned) -> list[str]:
    return [str(w.message) for w in warned if str(w.message).startswith("fagen: ")]


def dense_call():
    q, k, v = (torch.randn(1, 40, 2, 64, dtype=torch.float16) for _ in range(3))
    fagen.flash_attn_func(q, k, v)


def decode_call():
    q = torch.randn(2, 1, 2, 64, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, dtype=torch.float16) for _ in range(2))
    fagen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([5, 60], dtype=torch.int32))


def test_sm90_serves_after_a_passing_selftest_and_the_verdict_is_kept(stand_in, monkeypatch, capfd):
    use(monkeypatch, "PASSING")
    assert family_of_call(dense_call) == "sm90"
    assert family_of_call(decode_call) == "sm90"   # a decoding step's spec goes through the gate too
    assert runs_of(stand_in) == 4   # sm80.d64, sm90.d64, sm90.backward, sm90.decode: one self-test
    err = capfd.readouterr().err
    assert "fagen: testing its kernels on this GPU (Stand-in H100)" in err and "self-test: done in" in err
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm80")   # forcing a family wins over the verdict
    assert family_of_call(dense_call) == "sm80"
    monkeypatch.delenv("FAGEN_ARCH_FAMILY")
    gate.forget()   # a new process: the verdict comes from disk, and nothing runs again
    assert family_of_call(dense_call) == "sm90" and runs_of(stand_in) == 4
    monkeypatch.setattr(gate, "family_digest", lambda family: "edited")   # the family's sources changed
    gate.forget()
    assert family_of_call(dense_call) == "sm90" and runs_of(stand_in) == 8


def test_sm80_serves_after_a_failing_selftest(stand_in, monkeypatch):
    use(monkeypatch, "SM90_WRONG")
    with pytest.warns(RuntimeWarning) as warned:
        assert family_of_call(dense_call) == "sm80"
    message = str(warned[0].message)
    assert "sm90.d64 failed its self-test" in message and "fagen selftest --verbose" in message
    assert "Log: " in message and ".log" in message
    # a template no case proved (not_run) serves nothing either: the decoding step stays on sm80
    assert family_of_call(decode_call) == "sm80"
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")   # forcing the family still runs it
    assert family_of_call(dense_call) == "sm90"


def test_a_failed_sm90_backward_moves_the_backward_alone_to_sm80(stand_in, monkeypatch):
    """sm90.backward failed and sm90.d64 passed: a d = 64 call keeps the sm90 forward and runs the
    sm80 family's backward, whose templates replace sm90.backward; one warning says so."""
    use(monkeypatch, "SM90_BACKWARD_WRONG")
    with pytest.warns(RuntimeWarning) as warned:
        spec = spec_of_call(dense_call)
    assert spec.arch_family == "sm90" and spec.sm80_backward
    assert templates_of(spec) == ("sm90.d64", "sm80.d64")
    [message] = fagen_warnings(warned)
    assert "sm90 kernel template sm90.backward failed its self-test" in message
    assert "fagen selftest --verbose" in message and "Log: " in message
    assert "run their backward on the sm80 family, their forward on sm90" in message
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # warned once: the next spec's fallback is quiet
        assert gate.serving_spec(Spec(64, dtype="bf16"), cpu) == Spec(64, dtype="bf16", arch_family="sm90",
                                                                     sm80_backward=True)
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm80")   # forced onto sm80, a spec drops sm90's fallback
    assert gate.serving_spec(Spec(64, arch_family="sm90", sm80_backward=True), cpu) == Spec(64)


def test_a_failed_sm90_forward_still_sends_the_whole_call_to_sm80(stand_in, monkeypatch):
    use(monkeypatch, "SM90_BOTH_WRONG")
    with pytest.warns(RuntimeWarning) as warned:
        spec = spec_of_call(dense_call)
    assert spec.arch_family == "sm80" and not spec.sm80_backward
    messages = fagen_warnings(warned)
    assert sorted(m.split(" kernel template ")[1].split()[0] for m in messages) == ["sm90.backward", "sm90.d64"]
    assert all("the calls it would serve run on the sm80 family" in m for m in messages)


@pytest.mark.usefixtures("poisoned_outputs")
def test_the_sm90_forward_with_the_sm80_backward_matches_the_oracle():
    """What the gate serves where sm90.backward alone failed: one source of the sm90 forward and the
    sm80 family's backward, run by the emulator and held to FlashAttention-2's rule."""
    spec = Spec(64, arch_family="sm90", sm80_backward=True)
    assert KERNEL_FAMILIES["sm90"].backward_of(spec) is KERNEL_FAMILIES["sm80"].backward[0]
    run_and_check(spec, Shape(1, 40, 40, heads=2, kv_heads=1))


def test_a_failed_sm80_template_raises_at_first_use(stand_in, monkeypatch):
    use(monkeypatch, "SM80_WRONG")
    q, k, v = (torch.randn(1, 40, 2, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(SelftestFailure, match=r"sm80 kernel template sm80\.d64, which failed its self-test") as raised:
        fagen.flash_attn_func(q, k, v, causal=True)
    assert "FAGEN_SELFTEST=0" in str(raised.value) and "fagen selftest --verbose" in str(raised.value)
    runs = runs_of(stand_in)
    monkeypatch.setenv("FAGEN_SELFTEST", "0")   # the way past it: sm80, unchecked, no self-test
    assert family_of_call(dense_call) == "sm80" and runs_of(stand_in) == runs


def test_a_generated_module_with_a_failed_template_raises(stand_in, monkeypatch, tmp_path):
    """A generated op module runs its own .cu (no other family can serve it): the gate refuses it
    where a template it uses failed, as it refuses a call's sm80 spec."""
    import hashlib

    from fagen.kernels.render import render
    from fagen.ops import run_generated

    spec = Spec(64, mask="causal")
    code = render(spec).code
    path = tmp_path / f"{spec.name}.cu"
    path.write_text(code)
    q, k, v = (torch.randn(1, 40, 2, 64, dtype=torch.float16) for _ in range(3))

    def module_call():
        return run_generated(spec, path, hashlib.sha256(code.encode()).hexdigest(), q, k, v)

    use(monkeypatch, "SM80_WRONG")
    with pytest.raises(SelftestFailure, match=r"sm80 kernel template sm80\.d64, which failed its self-test"):
        module_call()
    monkeypatch.setenv("FAGEN_SELFTEST", "0")   # the way past it, as for every call
    assert family_of_call(module_call) == "sm80"


def test_selftest_off_runs_nothing_and_a_tuned_spec_keeps_its_family(stand_in, monkeypatch):
    use(monkeypatch, "PASSING")
    monkeypatch.setenv("FAGEN_SELFTEST", "0")
    assert gate.serving_spec(Spec(64), torch.device("cpu")).arch_family == "sm80"
    assert not selftest_dir().exists() and runs_of(stand_in) == 0
    monkeypatch.delenv("FAGEN_SELFTEST")
    assert gate.serving_spec(Spec(64), torch.device("cpu"), tuned=True).arch_family == "sm80"
    assert gate.serving_spec(Spec(64), torch.device("cpu")).arch_family == "sm90"


def test_concurrent_first_calls_run_one_selftest(stand_in, tmp_path):
    """Two processes ask for the stand-in's verdicts at once; the cases pause 3 s so that they
    overlap. One self-test runs (its two passing cases), and both read its verdicts."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(SUPPORT)!r})
        from fagen.selftest import gate
        from test_selftest_gate import STAND_IN
        gate.STAND_INS["cpu"] = STAND_IN
        gate.FIRST_USE = gate.FirstUse(cases="selftest_planted:PASSING", env=gate.FIRST_USE.env + {CHILD_ENV!r},
                                       budget_s=180.0, case_timeout_s=60.0)
        verdicts = gate.verdicts_for(STAND_IN)
        print(verdicts["sm90"].status("sm90.d64"), verdicts["sm80"].status("sm80.d64"))
    """)
    env = {**__import__("os").environ, PAUSE_ENV: "3", "PYTHONPATH": f"{SUPPORT.parent / 'selftest'}"}
    children = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for _ in range(2)]
    outputs = [child.communicate(timeout=240) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert [out.split() for out, _ in outputs] == [["passed", "passed"]] * 2
    assert runs_of(stand_in) == 4   # sm80.d64, sm90.d64, sm90.backward, sm90.decode, once
    assert sum("testing its kernels" in err for _, err in outputs) == 1
