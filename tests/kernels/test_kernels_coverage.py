"""The properties kernel mutants showed the rest of the suite did not pin down, FA-1 and FA-2,
forward and backward, against the float64 oracle (tests/support/kernel_cases.run_and_check):

- uneven key lengths, [Nk, Nk - 37, 1, 0], with and without causal: causal must align to each
  entry's own length, not the padded Nk;
- large logits (|S| in the hundreds): only the online softmax's max subtraction keeps exp2 from
  overflowing;
- a softmax_scale other than 1/sqrt(d), forward and backward;
- rows that see no key: exactly L = +inf (FA-1: m = -inf, l = 0), which run_and_check checks
  for every kernel test.
"""

import itertools

import pytest
import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.spec import Spec
import kernel_checks as checks
from kernel_cases import Shape, make_inputs

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

VERSIONS_AND_DTYPES = list(itertools.product((1, 2), ("fp16", "bf16")))


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("version", [1, 2])
def test_uneven_key_lengths(version, causal):
    checks.uneven_lengths_check(Spec(64, version=version, mask="causal" if causal else "none", key_padding=True))


def score_range(spec: Spec, shape: Shape, qk_scale: float) -> float:
    q, k, *_ = make_inputs(spec, shape, qk_scale=qk_scale)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / spec.head_dim ** 0.5
    return s.abs().max().item()


@pytest.mark.parametrize("version, dtype", VERSIONS_AND_DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_large_logits(version, dtype, causal):
    spec = Spec(64, version=version, dtype=dtype, mask="causal" if causal else "none")
    assert score_range(spec, checks.LARGE_LOGITS_SHAPE, checks.LARGE_LOGITS_QK_SCALE) > 300   # overflows exp2 unshifted
    checks.large_logits_check(spec)


@pytest.mark.parametrize("version", [1, 2])
def test_a_non_default_softmax_scale(version):
    checks.softmax_scale_check(Spec(64, version=version, mask="causal", dropout=True))


@pytest.mark.parametrize("version", [1, 2])
def test_rows_without_keys_carry_the_exact_contract(version):
    """L = +inf, never -inf or NaN (FA-1: m = -inf, l = 0): the backward's exp(S - L) = 0 needs it."""
    spec = Spec(64, version=version, mask="causal")
    q, k, v, _, _ = make_inputs(spec, Shape(1, 70, 20, heads=1, kv_heads=1))
    _, stats = attention_kernels.forward(render(spec), q, k, v)
    if version == 2:
        assert torch.equal(stats[0][0, 0, :50], torch.full((50,), float("inf")))   # rows i < Nq - Nk
        assert torch.isfinite(stats[0][0, 0, 50:]).all()
    else:
        assert torch.equal(stats[0][0, 0, :50], torch.full((50,), float("-inf")))
        assert torch.equal(stats[1][0, 0, :50], torch.zeros(50))
