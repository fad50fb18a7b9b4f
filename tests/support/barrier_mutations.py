"""Barrier mutations: a test of the tests (tests/kernels/test_barrier_mutations.py).

A mutant is a rendered variant with one `__syncthreads();` or one cp.async wait
(`fagen::cp_async_wait<N>();`, `fagen::cp_async_wait_all();`) deleted. Each is
run forward and backward under racecheck, on scenarios chosen so that every
barrier guards something (several K/V and Q tiles, two pipeline stages, causal
rows that see no key at all); a mutant is caught when racecheck reports a
hazard, the emulator reports a fault, or any output differs from the correct
variant's. Runs use one OS thread, so the correct variant's outputs are the
same bits every time (float atomics included).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from unittest import mock

import torch

from fagen.kernels import attention_kernels
from fagen.kernels import kv_kernels
from fagen.kernels.render import Source, render
from fagen.emulate import EmulationError
from fagen.spec import Spec
from kernel_cases import DROPOUT_P, OFFSET, SEED, Shape, make_inputs

BARRIER = re.compile(r"__syncthreads\(\);|fagen::cp_async_wait<[^>]*>\(\);|fagen::cp_async_wait_all\(\);")
ENTRY = re.compile(r'^extern "C" __global__ void __launch_bounds__\(\d+, 1\)$')

# The kernel families and the variants (more than one pipeline stage) that hold them.
FAMILIES = {
    "fwd_v2": Spec(64, mask="causal", block_m=64, block_n=32, num_stages=2),
    "fwd_v1": Spec(64, version=1, mask="causal", block_m=64, block_n=32, num_stages=2),
    "bwd_main": Spec(64, mask="causal"),
    "bwd_main_deterministic": Spec(64, mask="causal", deterministic=True),
    "bwd_dq_deterministic": Spec(64, mask="causal", deterministic=True),
    # Decoding: the forward over a paged cache (pages of 48 rows, 16-key tiles) in two splits.
    "fwd_kv_cache": Spec.for_kv_cache(64, "fp16", causal=True, page_size=48),
}
KERNEL_OF_FAMILY = {"fwd_v2": "_fwd", "fwd_v1": "_fwd", "bwd_main": "_bwd", "bwd_main_deterministic": "_bwd",
                    "bwd_dq_deterministic": "_bwd_dq", "fwd_kv_cache": "_fwd"}
# More queries than keys (causal rows with no key, and Q blocks with no K/V tile), more keys
# than queries, several blocks of each, and no key at all.
SCENARIOS = (Shape(1, 200, 90, heads=2, kv_heads=1), Shape(1, 90, 200, heads=2, kv_heads=1),
             Shape(1, 70, 0, heads=2, kv_heads=1))
# Racecheck sees shared memory (and stores of two blocks to one element); a barrier that
# guards global memory within a block shows as a wrong result, with outputs poisoned and a
# warp running a whole barrier interval ahead of the others.
RUNS = ({"FAGEN_EMULATE_RACECHECK": "1", "FAGEN_EMULATE_SCHEDULE": "forward"},
        {"FAGEN_EMULATE_RACECHECK": "0", "FAGEN_EMULATE_SCHEDULE": "warp-serial"},
        {"FAGEN_EMULATE_RACECHECK": "0", "FAGEN_EMULATE_SCHEDULE": "warp-serial-reverse"})

# Waits that no mutation can expose, and why they stay.
JUSTIFIED = {
    "fagen::cp_async_wait_all();": "the backward kernels' last wait: no later step reads a copy, but no "
                                   "thread should exit with a cp.async in flight (the PTX ISA does not define "
                                   "it; the emulator lands copies at exit)",
}


@dataclass(frozen=True)
class Mutant:
    family: str
    kernel: str
    line: int        # 1-based, in the rendered source
    statement: str
    start: int       # character offsets of the deleted statement
    end: int

    @property
    def name(self) -> str:
        return f"{self.family}:{self.line}:{self.statement}"


def mutants_of(family: str) -> list[Mutant]:
    spec = FAMILIES[family]
    code = render(spec).code
    wanted = spec.name + KERNEL_OF_FAMILY[family]
    found, kernel, offset = [], None, 0
    lines = code.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if ENTRY.match(line.rstrip("\n")) and number < len(lines):
            kernel = lines[number].strip().rstrip("(")
        if kernel == wanted:
            for match in BARRIER.finditer(line):
                found.append(Mutant(family, kernel, number, match.group(0), offset + match.start(),
                                    offset + match.end()))
        offset += len(line)
    return found


def all_mutants() -> list[Mutant]:
    return [m for family in FAMILIES for m in mutants_of(family)]


def run_kv_cache(source: Source, shape: Shape) -> list[torch.Tensor]:
    """A decoding step's forward: shape's queries against its keys in a shuffled paged cache,
    unsplit (O staged in shared memory) and split in two (partials from registers, the combine)."""
    page = 48
    gen = torch.Generator().manual_seed(shape.seqlen_q + shape.seqlen_k)
    pages = max(1, -(-shape.seqlen_k // page))
    table = torch.randperm(pages + 1, generator=gen)[:pages].view(1, pages).to(torch.int32)
    q = torch.randn(1, shape.seqlen_q, shape.heads, 64, generator=gen).half()
    k, v = (torch.randn(pages + 1, page, shape.kv_heads, 64, generator=gen).half() for _ in range(2))
    keys = torch.tensor([shape.seqlen_k], dtype=torch.int32)
    return [x for splits in (1, 2) for x in kv_kernels.forward_kv_cache(source, q, k, v, keys, seqlen_k=pages * page,
                                                                  block_table=table, num_splits=splits)]


def run_variant(source: Source, shape: Shape) -> list[torch.Tensor]:
    spec = source.spec
    if spec.kv_cache:
        return run_kv_cache(source, shape)
    q, k, v, dout, seqlens_k = make_inputs(spec, shape)
    p = DROPOUT_P if spec.dropout else 0.0
    out, stats = attention_kernels.forward(source, q, k, v, seqlens_k=seqlens_k, dropout_p=p, seed=SEED,
                                           philox_offset=OFFSET)
    drop = attention_kernels.dropout_args(p, SEED, OFFSET) if spec.dropout else None
    grads = attention_kernels.backward(source, q, k, v, out, stats, dout, seqlens_k=seqlens_k, dropout_args=drop)
    return [out, *stats, *grads]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.nan_to_num(1234.5), y.nan_to_num(1234.5)) for x, y in zip(a, b))


def justification(mutant: Mutant) -> str | None:
    """Why a surviving mutant's barrier stays (the backward kernels' final waits), or None."""
    if mutant.family.startswith("bwd") and mutant.statement in JUSTIFIED:
        return JUSTIFIED[mutant.statement]
    return None


def verdict(mutant: Mutant) -> str | None:
    """How the mutant was caught ("race ...", "fault ...", "wrong result ..."), or None.
    Outputs start poisoned (kernel_cases.poisoned_empty), so an element a mutant leaves
    unwritten, or computes from unwritten memory, differs."""
    from kernel_cases import poisoned_empty

    spec = FAMILIES[mutant.family]
    correct = render(spec)
    code = correct.code[:mutant.start] + "/* deleted by the mutation test */" + correct.code[mutant.end:]
    broken = Source(spec=spec, code=code, kernels=correct.kernels)
    with mock.patch.object(attention_kernels, "_empty", poisoned_empty):
        for run in RUNS:
            with mock.patch.dict(os.environ, {"FAGEN_EMULATE_THREADS": "1", **run}):
                for shape in SCENARIOS:
                    expected = run_variant(correct, shape)
                    try:
                        got = run_variant(broken, shape)
                    except EmulationError as error:
                        kind = "race" if "racecheck:" in str(error) else "fault"
                        return f"{kind} ({run['FAGEN_EMULATE_SCHEDULE']}) on {shape}: {str(error)[:300]}"
                    if not same(expected, got):
                        return f"wrong result ({run['FAGEN_EMULATE_SCHEDULE']}) on {shape}"
    return None
