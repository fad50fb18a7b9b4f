"""Which family serves a call on this GPU, by the self-test's verdicts: the sm90 family by default
on compute capability 9.0 once its templates passed there, and never a kernel that failed.

`serving_spec(spec, device)` is the one place the ops ask (a call's Source is memoised after it,
so a warm call never comes here). On a GPU, unless FAGEN_SELFTEST=0:

  - FAGEN_ARCH_FAMILY forces a family, and a tuned entry's family wins (the tuner checked its
    output on this GPU before timing it); otherwise, on compute capability 9.0, a Spec the sm90
    family takes runs there when every sm90 template it uses passed (templates.templates_of);
    where all but `sm90.backward` did, its forward still runs there and its backward is the sm80
    family's (`Spec.sm80_backward`, whose sm80 templates are checked as below); else the whole
    call runs on sm80. Each template that did not pass is named once in a warning, with what runs
    instead, the log and `fagen selftest --verbose`;
  - a Spec whose sm80 templates failed or hung raises `SelftestFailure`: nothing safer is behind
    the sm80 family, and a wrong result must never come back silently.

The first eligible call with no stored verdict runs the self-test (fagen.selftest.watchdog),
saying so on stderr, under a file lock per GPU so that the ranks of one node run it once, within
`FIRST_USE.budget_s`. On the CPU the emulator runs both families and nothing is tested, unless a
test stands a device in (`STAND_INS`).
"""

from __future__ import annotations

import functools
import hashlib
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace

from ..arch_families import ARCH_FAMILY_ENV, FAMILIES, chosen_decoding_spec, chosen_family
from ..environment import setting
from ..version import __version__
from .templates import all_templates, sources_digest, templates_of
from .verdicts import Verdict, VerdictKey, log_path, read_verdict, selftest_dir, write_verdict
from .watchdog import CASE_TIMEOUT_S, DEFAULT_CASES, RunPlan, run_selftest

SELFTEST_ENV = "FAGEN_SELFTEST"
HOPPER = (9, 0)


class SelftestFailure(RuntimeError):
    """A call needs a kernel that failed the self-test on this GPU."""


@dataclass(frozen=True)
class DeviceFacts:
    """What a verdict is keyed by, and where the self-test's child runs."""

    capability: tuple
    gpu: str
    driver: str
    runtime: str
    nvrtc: str
    device: str          # the child's --device: "cuda:0", or "cpu" for a test's stand-in

    @property
    def families(self) -> tuple[str, ...]:
        """The families the self-test proves on this device: sm80 on every GPU, sm90 on 9.0."""
        return tuple(family.name for family in FAMILIES.values() if family.capability in (None, self.capability))


@dataclass(frozen=True)
class FirstUse:
    """How the first eligible call runs the self-test (tests plant their own cases and clocks)."""

    budget_s: float = 60.0
    case_timeout_s: float = CASE_TIMEOUT_S
    cases: str = DEFAULT_CASES
    env: tuple = ()          # (name, value) pairs for the child's environment


FIRST_USE = FirstUse()
STAND_INS: dict = {}         # {"cpu": DeviceFacts}: a test's stand-in GPU on the emulator
_verdicts: dict = {}         # {(VerdictKey, ...): {family: Verdict}}
_warned: set = set()
_digests: dict = {}
_fixed_checked: set = set()   # (spec name, device, GENERATION) that check_fixed_spec let through
_lock = threading.Lock()
GENERATION = [0]             # bumped when a verdict is learnt or forgotten: memos of calls start over


def device_facts(device) -> DeviceFacts | None:
    """A CUDA device's facts (cached per ordinal), a test's stand-in, or None (the CPU)."""
    if device.type == "cuda":
        import torch

        return _cuda_facts(torch.cuda.current_device() if device.index is None else device.index)
    return STAND_INS.get(device.type)


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    import torch

    from ..tuning.device import DeviceIdentity

    identity = DeviceIdentity.from_device(index)
    return DeviceFacts(torch.cuda.get_device_capability(index), identity.name, identity.driver, _runtime_version(),
                       identity.nvrtc, f"cuda:{index}")


def _runtime_version() -> str:
    try:
        import cupy

        version = cupy.cuda.runtime.runtimeGetVersion()
        return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - no CuPy: torch's build names the runtime it ships
        import torch

        return str(torch.version.cuda)


def verdict_keys(facts: DeviceFacts) -> dict:
    return {family: VerdictKey(family, facts.gpu, facts.driver, facts.runtime, facts.nvrtc, __version__,
                               family_digest(family)) for family in facts.families}


def family_digest(family: str) -> str:
    """The family's sources' hash, computed once per process (until `forget`)."""
    digest = _digests.get(family)
    if digest is None:
        from pathlib import Path

        from ..kernels.render import template_dir

        digest = _digests[family] = sources_digest(family, Path(template_dir()), Path(__file__).resolve().parents[1])
    return digest


def serving_spec(spec, device, *, decoding: bool = False, tuned: bool = False):
    """`spec` in the family that serves it on `device` (see the module doc); `decoding` for a
    kv-cache step's spec (arch_families.chosen_decoding_spec), `tuned` when a tuning result
    chose its tiles."""
    requested = setting(ARCH_FAMILY_ENV)
    facts = device_facts(device)
    capability = facts.capability if facts is not None else None
    choose = chosen_decoding_spec if decoding else _in_chosen_family
    if facts is None or setting(SELFTEST_ENV) == "0":
        return choose(spec, requested, capability)
    verdicts = verdicts_for(facts)
    chosen = choose(spec, requested, capability)
    if not requested and not tuned:
        for family in _made_for(capability):
            candidate = choose(spec, family.name, capability)
            if candidate.arch_family != family.name:   # the family does not take it
                continue
            served = _proven_spec(candidate, verdicts[family.name], facts)
            if served is not None:
                chosen = served
                break
    _refuse_broken(chosen, verdicts["sm80"], facts)
    return chosen


def check_fixed_spec(spec, device) -> None:
    """A Spec no other family can serve (a generated op module runs its own .cu file): raise
    `SelftestFailure` where a template it uses, of any family (an sm90 spec may run sm80's
    backward), failed or hung on this GPU, as for an sm80 template in `serving_spec`. Nothing runs
    where the gate would run nothing."""
    facts = device_facts(device)
    if facts is None or setting(SELFTEST_ENV) == "0" or spec.arch_family not in facts.families:
        return
    checked = (spec.name, facts.device, GENERATION[0])   # a warm call's check: one set lookup
    if checked not in _fixed_checked:
        verdicts = verdicts_for(facts)
        for family in facts.families:
            _refuse_broken(spec, verdicts[family], facts)
        _fixed_checked.add((spec.name, facts.device, GENERATION[0]))   # verdicts_for may have moved GENERATION


def _made_for(capability) -> list:
    """The families made for this compute capability alone (sm90 on 9.0): where they take a spec
    and passed the self-test, they serve it by default."""
    return [family for family in FAMILIES.values() if family.capability is not None and family.capability == capability]


def _in_chosen_family(spec, requested: str, capability):
    family = chosen_family(spec, requested, capability)
    # sm80_backward means something to an sm90 spec alone: another family's spec drops it.
    return spec if family == spec.arch_family else spec.replace(arch_family=family, sm80_backward=False)


def _proven_spec(spec, verdict: Verdict, facts: DeviceFacts):
    """`spec` (of a family made for this GPU: sm90) where every template of its own family it uses
    passed; where all but its own backward did (`sm90.backward`), `spec` with the sm80 family's
    backward (Spec.sm80_backward), the forward staying on its family; else None. Warns once per
    template that did not pass, saying what runs on sm80 instead."""
    unproven = _unproven(spec, verdict)
    if unproven == [f"{spec.arch_family}.backward"]:
        fallback = spec.replace(sm80_backward=True)   # its sm80 templates: _refuse_broken's to check
        if not _unproven(fallback, verdict):
            _warn_unproven(verdict, unproven[0], facts, f"the calls it would serve run their backward on the sm80 "
                                                        f"family, their forward on {spec.arch_family}")
            return fallback
    for template in unproven:
        _warn_unproven(verdict, template, facts, "the calls it would serve run on the sm80 family")
    return None if unproven else spec


def _unproven(spec, verdict: Verdict) -> list[str]:
    """The templates of `verdict`'s family that `spec` uses and that did not pass."""
    return verdict.unproven([t for t in templates_of(spec) if t.startswith(verdict.key.family + ".")])


def _warn_unproven(verdict: Verdict, template: str, facts: DeviceFacts, instead: str) -> None:
    """Warn once per process (until `forget`) that `template` did not pass, and what runs `instead`."""
    if template in _warned:
        return
    _warned.add(template)
    result = verdict.results.get(template)
    warnings.warn(f"fagen: the {verdict.key.family} kernel template {template} {_status_text(verdict, template)} on "
                  f"this GPU ({facts.gpu}){': ' + result.detail if result and result.detail else ''}; {instead}. "
                  f"Log: {verdict.log}. Rerun it with `fagen selftest --verbose`.", RuntimeWarning, stacklevel=5)


def _refuse_broken(spec, verdict: Verdict, facts: DeviceFacts) -> None:
    """Raise for a template of `verdict`'s family (sm80's, unless a fixed spec's own) that `spec`
    uses and that failed or hung; warn once for one the self-test did not reach (its calls run
    unchecked, as with FAGEN_SELFTEST=0)."""
    family = verdict.key.family
    used = [t for t in templates_of(spec) if t.startswith(family + ".")]
    for template in verdict.unproven(used):
        if template not in _warned and template not in verdict.broken(used):
            _warned.add(template)
            warnings.warn(f"fagen: the {family} kernel template {template} {_status_text(verdict, template)} on this "
                          f"GPU ({facts.gpu}); its calls run unchecked. Log: {verdict.log}. Rerun it with `fagen "
                          f"selftest --verbose`.", RuntimeWarning, stacklevel=4)
    broken = verdict.broken(used)
    if broken:
        template = broken[0]
        result = verdict.results[template]
        raise SelftestFailure(
            f"fagen: {spec.name} needs the {family} kernel template {template}, which "
            f"{_status_text(verdict, template)} on this GPU ({facts.gpu}): {result.detail}. Log: {verdict.log}. "
            f"Rerun it with `fagen selftest --verbose`; FAGEN_SELFTEST=0 runs the kernels unchecked.")


def _status_text(verdict: Verdict, template: str) -> str:
    return {"failed": "failed its self-test", "timed_out": "hung in its self-test (the watchdog ended it)",
            "not_run": "was not reached by the self-test"}.get(verdict.status(template), "did not pass its self-test")


def verdicts_for(facts: DeviceFacts) -> dict:
    """{family: Verdict} for `facts`: from memory, else from disk, else by running the self-test
    (once per GPU across processes: a file lock)."""
    keys = verdict_keys(facts)
    memo = tuple(keys.values())
    found = _verdicts.get(memo)
    if found is not None:
        return found
    with _lock:
        found = _verdicts.get(memo) or _stored_or_run(facts, keys)
        _verdicts[memo] = found
        GENERATION[0] += 1
    return found


def _stored_or_run(facts: DeviceFacts, keys: dict) -> dict:
    from filelock import FileLock

    found = {family: read_verdict(key) for family, key in keys.items()}
    if all(found.values()):
        return found
    selftest_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(selftest_dir() / f"{_gpu_digest(facts)}.lock")):
        found = {family: read_verdict(key) for family, key in keys.items()}   # another rank's, meanwhile
        missing = tuple(family for family, verdict in found.items() if verdict is None)
        if missing:
            found.update(run_and_store(facts, {f: keys[f] for f in missing}, FIRST_USE, _announce(facts)))
    return found


def _gpu_digest(facts: DeviceFacts) -> str:
    """The lock's name: one per GPU model and toolchain, not per ordinal, so that the ranks of a
    node (one GPU each, all alike) wait for one self-test and share its verdicts."""
    return hashlib.sha256(f"{facts.gpu}|{facts.driver}|{facts.runtime}|{facts.nvrtc}".encode()).hexdigest()[:16]


def run_and_store(facts: DeviceFacts, keys: dict, settings: FirstUse, progress, templates=None) -> dict:
    """Run the self-test of `keys`' families (only `templates` of them, if given) on `facts`'
    device and store each family's verdict, the results of templates not run kept from the stored
    one; {family: Verdict} of what ran."""
    templates = tuple(t for family in keys for t in all_templates(family) if not templates or t in templates)
    log = log_path(next(iter(keys.values())))
    plan = RunPlan(facts.device, templates, log, budget_s=settings.budget_s, case_timeout_s=settings.case_timeout_s,
                   cases=settings.cases, compile_first=facts.device.startswith("cuda"), env=dict(settings.env))
    start = time.monotonic()
    progress(f"start {len(templates)} templates of the {' and '.join(keys)} famil{'ies' if len(keys) > 1 else 'y'}")
    results = run_selftest(plan, progress)
    seconds = time.monotonic() - start
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    verdicts = {}
    for family, key in keys.items():
        mine = {t: r for t, r in results.items() if t.startswith(family + ".")}
        verdicts[family] = Verdict(key, mine, str(log), seconds, stamp)
        kept = read_verdict(key)
        write_verdict(replace(verdicts[family], results={**(kept.results if kept else {}), **mine}))
    passed = sum(r.status == "passed" for r in results.values())
    progress(f"done in {seconds:.1f} s: {passed} of {len(results)} templates passed; log {log}")
    return verdicts


def _announce(facts: DeviceFacts):
    """Progress on stderr: what runs and why once, then one line per template that did not pass
    and a last line with the time taken."""
    print(f"fagen: testing its kernels on this GPU ({facts.gpu}) before their first use; once per GPU, "
          f"driver and fagen version (FAGEN_SELFTEST=0 skips it)", file=sys.stderr, flush=True)

    def progress(line: str) -> None:
        if line.startswith(("compiled", "done")) or (line.startswith("[") and not line.endswith("passed")):
            print(f"fagen: self-test: {line}", file=sys.stderr, flush=True)
    return progress


def forget() -> None:
    """Drop the verdicts held in memory (and the sources' hashes): the next call reads the disk."""
    with _lock:
        _verdicts.clear()
        _warned.clear()
        _digests.clear()
        _fixed_checked.clear()
        GENERATION[0] += 1


def with_first_use(**changes) -> FirstUse:
    return replace(FIRST_USE, **changes)
