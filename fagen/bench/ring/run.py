"""The ring section's run: a world-1 process group (NCCL on a GPU, else gloo), equality and timing
per layout, then the overlap model's rows (config.RingConfig).

The plain op is timed once; per layout, unshard(ring_attention) is checked against
fagen.flash_attn_func and the ring and each of the step's pair kernels (from fagen.distributed's
step_blocks, `ring_pairs`) are timed; per modelled world, one full c x c pair. torch and fagen are
imported inside the functions; fagen.distributed through the front door (`import fagen`).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Callable

from ..timing import Deadline, Timing, time_cuda
from .config import PAIRS_AT_WORLD_ONE, equality_tolerance, overlap_row
from .markdown import add_ratios, section_note

GUARD_REASON = "time guard (the section's deadline was reached)"
NEED_S = 1.0   # left in the section for one more measurement


def _distributed():
    import fagen

    return fagen.distributed


def ring_pairs(layout: str, world: int = 1, rank: int = 0, step: int = 0) -> list:
    """The causal chunk pairs (fagen.distributed.ring.step_blocks) rank `rank` runs at `step`."""
    return _distributed().ring.step_blocks(layout, world, rank, (rank - step) % world, True)


def pair_equivalents(layout: str, world: int) -> float:
    """The least work, in full c x c pairs (a causal diagonal pair counts half), any rank has in a
    step with a K/V transfer in flight (steps 0 .. W-2; at world 1 the one step): the step whose
    transfer is hardest to hide."""
    steps = range(max(1, world - 1))
    return min(sum(0.5 if b.causal else 1.0 for b in ring_pairs(layout, world, rank, step))
               for rank in range(world) for step in steps)


def check_pair_counts(config) -> str:
    """The dry run's check: step_blocks gives the pair counts the plan counts on."""
    found = {layout: len(ring_pairs(layout)) for layout in config.layouts}
    expected = {layout: PAIRS_AT_WORLD_ONE.get(layout) for layout in config.layouts}
    per_step = {w: pair_equivalents("zigzag", w) for w in config.model_worlds}
    if found != expected or any(p != 2.0 for p in per_step.values()):
        raise ValueError(f"pairs at world 1 {found} (expected {expected}); zigzag pairs per step {per_step} "
                         "(expected 2 full blocks)")
    return (f"world 1 pairs: {', '.join(f'{k} {v}' for k, v in found.items())}; zigzag pairs per step at W = "
            + ", ".join(f"{w}: {p:g}" for w, p in per_step.items()))


class _Section:
    def __init__(self, config, deadline: Deadline, timer, timer_kwargs: dict, log):
        self.config, self.deadline, self.timer, self.timer_kwargs, self.log = config, deadline, timer, timer_kwargs, log
        self.data: dict = {"status": "ok", "note": "", "backend": None, "plain": {}, "layouts": {},
                           "config": {"label": config.label, "cap_s": config.cap_s},
                           "model": {"label": "model, not measured", "links": dict(config.links), "rows": []}}

    def measure(self, fn: Callable[[], object]) -> dict:
        """A cell: the median time of `fn`, or why there is none."""
        if self.deadline.expired(NEED_S):
            return {"skipped": GUARD_REASON}
        try:
            timing: Timing = self.timer(fn, **self.timer_kwargs)
            return timing.to_dict()
        except Exception as exc:  # noqa: BLE001 - a failure is a recorded reason
            return {"skipped": _reason(exc)}


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _process_group(device: str):
    """A world-1 default group (NCCL on a GPU, else gloo) and its store's folder."""
    import torch.distributed as dist

    folder = tempfile.mkdtemp(prefix="fagen-ring-")
    backends = ["nccl", "gloo"] if device == "cuda" and dist.is_nccl_available() else ["gloo"]
    errors = []
    for backend in backends:
        try:
            dist.init_process_group(backend, init_method=f"file://{folder}/store-{backend}", rank=0, world_size=1)
            return backend, folder
        except Exception as exc:  # noqa: BLE001 - try the next backend
            errors.append(f"{backend}: {_reason(exc)}")
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError("no process group: " + "; ".join(errors))


def _inputs(config, device: str):
    import torch

    from ...dtypes import TORCH_DTYPE

    dtype = TORCH_DTYPE[config.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (config.batch, config.seqlen)
    q = torch.randn(*shape, config.heads, config.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(*shape, config.kv_heads, config.head_dim, generator=gen, device=device, dtype=dtype)
            for _ in range(2))
    return q, k, v


def _equality(q, k, v, layout: str, plain_out) -> dict:
    distributed = _distributed()
    try:
        shards = [distributed.shard(t, layout) for t in (q, k, v)]
        out = distributed.unshard(distributed.ring_attention(*shards, causal=True, layout=layout), layout)
        err = float((out.float() - plain_out.float()).abs().max())
        tol = equality_tolerance(float(plain_out.float().abs().max()))
        return {"ok": err <= tol, "max_err": err, "tol": tol}
    except Exception as exc:  # noqa: BLE001
        return {"skipped": _reason(exc)}


def _pair_calls(q, k, v, layout: str) -> list[Callable[[], object]]:
    """The step's pair kernels as flash_attn_func calls on their (copied) chunks: at world 1 the
    shard's slots are the global chunks, in local order."""
    import fagen

    distributed = _distributed()
    slots = len(distributed.layout.chunks_of(layout, 1, 0))
    chunk = q.shape[1] // slots
    shards = [distributed.shard(t, layout) for t in (q, k, v)]

    def rows(t, slot):
        return t[:, slot * chunk:(slot + 1) * chunk].contiguous()

    calls = []
    for block in ring_pairs(layout):
        qc, kc, vc = rows(shards[0], block.q_slot), rows(shards[1], block.k_slot), rows(shards[2], block.k_slot)
        calls.append(lambda qc=qc, kc=kc, vc=vc, causal=block.causal: fagen.flash_attn_func(qc, kc, vc,
                                                                                           causal=causal))
    return calls


def _layout_cell(run: _Section, q, k, v, layout: str, plain_out) -> dict:
    distributed = _distributed()
    cell: dict = {"equal": _equality(q, k, v, layout, plain_out)}
    try:
        shards = [distributed.shard(t, layout) for t in (q, k, v)]
        cell["ring"] = run.measure(lambda: distributed.ring_attention(*shards, causal=True, layout=layout))
        pairs = [run.measure(call) for call in _pair_calls(q, k, v, layout)]
    except Exception as exc:  # noqa: BLE001
        cell.setdefault("ring", {"skipped": _reason(exc)})
        pairs = [{"skipped": _reason(exc)}]
    skipped = next((p for p in pairs if "ms" not in p), None)
    each = [p["ms"] for p in pairs if "ms" in p]
    cell["pairs"] = dict(skipped) if skipped else {"ms": sum(each), "each_ms": each}
    cell["pairs"]["count"] = len(pairs)
    return cell


def _model_row(run: _Section, q, k, v, world: int) -> dict:
    """One world of the overlap model, from a measured full c x c pair at its chunk length."""
    import fagen

    config = run.config
    c = config.chunk(world)
    head = {"world": world, "chunk": c}
    try:
        qc, kc, vc = (t[:, :c].contiguous() for t in (q, k, v))
        cell = run.measure(lambda: fagen.flash_attn_func(qc, kc, vc, causal=False))
        if "ms" not in cell:
            return {**head, **cell}
        row = overlap_row(world, pair_equivalents("zigzag", world), cell["ms"], config.kv_bytes(world), config.links)
        return {**head, **row}
    except Exception as exc:  # noqa: BLE001
        return {**head, "skipped": _reason(exc)}


def run_ring_section(plan, deadline: Deadline, *, device: str = "cuda", timer: Callable[..., Timing] = time_cuda,
                     log: Callable[[str], None] = print) -> dict:
    """Equality and timing per layout in a world-1 group, then the overlap model, within `deadline`."""
    import fagen  # noqa: F401 - fagen.distributed comes with it
    import torch.distributed as dist

    config = plan.ring
    run = _Section(config, deadline, timer, {"warmup": plan.warmup, "min_repeats": plan.min_repeats,
                                             "max_repeats": plan.max_repeats, "target_ms": plan.target_ms}, log)
    if not config.enabled:
        run.data["note"] = "no ring section in this plan"
        return run.data
    try:
        run.data["backend"], folder = _process_group(device)
    except Exception as exc:  # noqa: BLE001 - recorded: the section cannot run without a group
        return {**run.data, "status": "error", "note": _reason(exc)}
    try:
        _measure_all(run, device)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    add_ratios(run.data)
    failed = any((cell.get("equal") or {}).get("ok") is False for cell in run.data["layouts"].values())
    run.data["status"] = "failed" if failed else "ok"
    run.data["note"] = section_note(run.data)
    return run.data


def _measure_all(run: _Section, device: str) -> None:
    import fagen

    q, k, v = _inputs(run.config, device)
    plain_out = fagen.flash_attn_func(q, k, v, causal=True)
    run.data["plain"] = run.measure(lambda: fagen.flash_attn_func(q, k, v, causal=True))
    for layout in run.config.layouts:
        run.data["layouts"][layout] = _layout_cell(run, q, k, v, layout, plain_out)
        run.log(f"   ring {layout}: {run.data['layouts'][layout]['equal']}")
    run.data["model"]["rows"] = [_model_row(run, q, k, v, world) for world in run.config.model_worlds]
