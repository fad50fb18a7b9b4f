"""A test of the tests: named wrong kernels (tests/support/kernel_mutants.py), each killed by the
checks that claim to cover it (tests/support/kernel_checks.py).

CI runs a sample of the kernel mutants and, as a positive control, every check on the
unmutated kernels (a check that fails there would "kill" any mutant; the two slowest in the slow tier). The slow tier
(`python -m pytest -q -m slow tests/kernels/test_kernel_mutants.py`) runs every kernel mutant and
prints the mutation score over them and the barrier deletions of tests/support/barrier_mutations.py;
the target is 100%.
"""

import os
from unittest import mock

import pytest

import kernel_mutants as km
from fagen.kernels import attention_kernels
from kernel_cases import poisoned_empty

BY_NAME = {m.name: m for m in km.MUTANTS}
CHECKS = sorted({(m.spec, check) for m in km.MUTANTS for check in m.checks},
                key=lambda pair: (pair[0].name, pair[1].__name__))
# Each unmutated check runs in the tier of its mutants: the default tier's for the sampled mutants'
# checks (km.SAMPLE, test_sampled_mutants_are_killed), the slow tier's for the rest. CI keeps its
# 20 minutes; every check still passes on its kernel there, and the kernels' own tests check them.
SAMPLED_CHECKS = {(m.spec.name, check.__name__) for m in km.MUTANTS if m.name in km.SAMPLE for check in m.checks}
CHECK_PARAMS = [pytest.param(spec, check, id=f"{spec.name}-{check.__name__}",
                             marks=() if (spec.name, check.__name__) in SAMPLED_CHECKS else pytest.mark.slow)
                for spec, check in CHECKS]


def test_the_mutants_cover_what_the_issue_lists_and_their_edits_apply():
    assert len(BY_NAME) == len(km.MUTANTS) and set(km.SAMPLE) <= set(BY_NAME)
    for mutant in km.MUTANTS:
        assert mutant.host or mutant.source().code != km.render(mutant.spec).code, mutant.name


@pytest.mark.parametrize("spec, check", CHECK_PARAMS)
def test_every_check_passes_on_the_unmutated_kernel(spec, check):
    with mock.patch.object(attention_kernels, "_empty", poisoned_empty), \
            mock.patch.dict(os.environ, {"FAGEN_EMULATE_THREADS": "1"}):
        check(spec, None)


@pytest.mark.parametrize("name", km.SAMPLE)
def test_sampled_mutants_are_killed(name):
    assert km.killed_by(BY_NAME[name]) is not None, f"mutant {name!r} survives its checks"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in km.MUTANTS])
def test_every_kernel_mutant_is_killed(name):
    assert km.killed_by(BY_NAME[name]) is not None, f"mutant {name!r} survives its checks"


@pytest.mark.slow
def test_mutation_score_is_100_percent(capsys):
    killed, total, survivors = km.mutation_score()
    with capsys.disabled():
        twins = len(km.twin_mutants.all_planted())
        print(f"\nmutation score: {killed}/{total} = {100 * killed / total:.1f}% "
              f"({len(km.MUTANTS)} kernel mutants, {total - len(km.MUTANTS) - twins} barrier deletions, "
              f"{twins} bugs planted in the twins' micro-kernels)")
    assert not survivors, f"surviving mutants: {survivors}"
