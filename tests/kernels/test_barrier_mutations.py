"""A test of the tests: every barrier and cp.async wait of the kernel families, deleted in
turn, is caught as a race (racecheck) or a wrong result (tests/support/barrier_mutations.py).

CI runs a sample, one of each kind of guard; the whole list is the slow tier
(`python -m pytest -q -m slow tests/kernels/test_barrier_mutations.py`). A mutant no run
can catch must have its barrier justified (barrier_mutations.JUSTIFIED) or
removed from the template as redundant.
"""

import pytest

import barrier_mutations as bm

ALL = bm.all_mutants()
# One of each guard: a pipeline wait, the barrier after it, the stage-refill barrier (the
# FA-2 forward's trailing one), the dS barrier of the backward, the deterministic dQ
# kernel's refill barrier, and FA-1's barrier guarding its HBM accumulators.
SAMPLE_KEYS = [("fwd_v2", "fagen::cp_async_wait<kStages - 1>();", 0), ("fwd_v2", "__syncthreads();", 1),
               ("fwd_v2", "__syncthreads();", 0), ("bwd_main", "__syncthreads();", 1),
               ("bwd_dq_deterministic", "__syncthreads();", 1), ("fwd_v1", "__syncthreads();", 0)]


def pick(family: str, statement: str, index: int) -> bm.Mutant:
    return [m for m in ALL if m.family == family and m.statement.startswith(statement)][index]


SAMPLE = [pick(*key) for key in SAMPLE_KEYS]


def test_the_kernels_without_barriers_still_have_none():
    """bwd_preprocess and bwd_dq_convert use no shared memory: nothing to mutate. If one gains
    a barrier, it must join FAMILIES."""
    for spec in (bm.FAMILIES["bwd_main"], bm.FAMILIES["fwd_v1"]):
        source = bm.render(spec)
        for entry in (source.kernels.bwd_preprocess, source.kernels.bwd_dq_convert):
            if entry is None:
                continue
            body = source.code.split(f"{entry.name}(", 1)[1].split("FAGEN_EXPORT(", 1)[0]
            assert not bm.BARRIER.search(body), entry.name


def test_every_family_has_mutants_and_the_sample_is_distinct():
    assert {m.family for m in ALL} == set(bm.FAMILIES)
    assert len({m.name for m in SAMPLE}) == len(SAMPLE)
    assert any("every warp is done with this stage" in bm.render(bm.FAMILIES["fwd_v2"]).code[m.end:m.end + 80]
               for m in SAMPLE)


@pytest.mark.parametrize("mutant", SAMPLE, ids=lambda m: m.name)
def test_sampled_barrier_deletions_are_caught(mutant):
    assert bm.verdict(mutant) is not None, f"deleting {mutant.name} is caught by nothing"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ALL, ids=lambda m: m.name)
def test_every_barrier_deletion_is_caught_or_justified(mutant):
    caught = bm.verdict(mutant)
    assert caught is not None or bm.justification(mutant) is not None, (
        f"deleting {mutant.name} is caught by nothing: remove the barrier as redundant (saying why) "
        f"or justify it in barrier_mutations.JUSTIFIED")
