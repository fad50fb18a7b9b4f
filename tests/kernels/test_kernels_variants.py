"""Attention variants on the emulator against the float64 oracle (FlashAttention-2's rule):
each built-in alone in both versions, combinations, custom score_mod / mask_mod (with a
captured tensor's gradient), sinks and the differentiable L (every case gives L an
upstream gradient), and the tiles the kernels visit against the dense mask."""

import pytest
import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.reference.problem import make_problem
from fagen.spec import Spec
from kernel_cases import Shape, make_inputs
from variant_cases import run_variant_case, variant_spec

RAGGED = Shape(2, 150, 170, heads=2, kv_heads=1)
SLOPES = torch.tensor([0.25, 0.0625])
SINKS = torch.tensor([0.5, -1.0])

BUILTINS = {
    "window": {"window_size": (20, 7)},
    "window_left_only": {"window_size": (33, -1)},
    "softcap": {"softcap": 2.5},
    "alibi": {"alibi_slopes": SLOPES},
    "alibi_per_batch": {"alibi_slopes": torch.tensor([[0.25, 0.0625], [0.5, 0.125]])},
    "sinks": {"sinks": SINKS},
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", BUILTINS)
def test_each_builtin_alone(name, version):
    run_variant_case(Spec(64, version=version), RAGGED, BUILTINS[name])


@pytest.mark.parametrize("version", [1, 2])
def test_window_with_causal(version):
    run_variant_case(Spec(64, version=version, mask="causal"), Shape(1, 200, 90, heads=2, kv_heads=2),
                     {"window_size": (40, -1)})


@pytest.mark.parametrize(("version", "dtype"), [(2, "bf16"), (1, "fp16")])
def test_window_softcap_alibi_with_dropout_gqa_and_key_padding(version, dtype):
    base = Spec(64, version=version, dtype=dtype, mask="causal", key_padding=True, dropout=True)
    run_variant_case(base, Shape(3, 130, 150, heads=4, kv_heads=2),
                     {"window_size": (45, -1), "softcap": 3.0, "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                      "sinks": torch.tensor([0.0, 1.0, -0.5, 2.0])})


def test_deterministic_variant():
    base = Spec(64, mask="causal", deterministic=True)
    run_variant_case(base, RAGGED, {"window_size": (30, -1), "softcap": 2.0, "sinks": SINKS})


def test_alibi_alone_deterministic_with_sinks_and_key_padding():
    # ALiBi alone adds its bias to the raw scores (variants.cuda alibi_raw_scale) in the forward,
    # the backward and the deterministic dQ pass; sinks then enter in raw units too.
    base = Spec(64, mask="causal", key_padding=True, deterministic=True)
    run_variant_case(base, RAGGED, {"alibi_slopes": torch.tensor([[0.25, 0.0625], [0.5, 0.125]]), "sinks": SINKS})


def test_softcap_alone_non_causal_with_sinks():
    # The softcap alone runs in units of the cap (variants.cuda capped_score), sinks too.
    run_variant_case(Spec(64, key_padding=True), RAGGED, {"softcap": 5.0, "sinks": SINKS})


def test_softcap_alone_with_dropout():
    # With dropout the main backward kernel keeps the score chain (the cap's units cost it
    # registers it does not have at d = 128); the forward and L stay in the cap's units.
    run_variant_case(Spec(64, mask="causal", dropout=True), RAGGED, {"softcap": 3.0})


@pytest.mark.parametrize("head_dim", [32, 128])
def test_other_head_dims(head_dim):
    run_variant_case(Spec(head_dim, mask="causal"), Shape(1, 90, 100, heads=2, kv_heads=1),
                     {"window_size": (25, -1), "softcap": 4.0})


def test_relative_position_bias_table_with_its_gradient():
    bias = (torch.randn(2, 400, generator=torch.Generator().manual_seed(3)) * 0.5).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 199]

    run_variant_case(Spec(64, mask="causal"), RAGGED, {"score_mod": score_mod}, captures=(bias,))


@pytest.mark.parametrize("head_dim", [160, 256])
def test_a_captured_tensors_gradient_counts_each_score_once_where_warps_split_d(head_dim):
    # Past d = 128 the backward's warps of a key group split d: each computes the same scores for
    # its slice of dK and dV, and each added them to the captured tensor's gradient (2x, 4x).
    bias = (torch.randn(2, 400, generator=torch.Generator().manual_seed(3)) * 0.5).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 199]

    run_variant_case(Spec(head_dim, mask="causal"), RAGGED, {"score_mod": score_mod}, captures=(bias,))


def test_a_captured_tensor_inside_a_nonlinearity_gets_its_gradient():
    # sigmoid's derivative divides by (1 + e^-x)^2: printed once as a/(t1) * (t1) (CudaPrinter),
    # which made dQ, dK and this tensor's gradient wrong.
    bias = (torch.randn(2, 150, generator=torch.Generator().manual_seed(5)) * 0.5).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.sigmoid(score + bias[b, q_idx]) * 4

    run_variant_case(Spec(64, mask="causal"), RAGGED, {"score_mod": score_mod}, captures=(bias,))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_document_mask(dtype):
    # int64 ids keep 64-bit summaries (variants.cuda.summary_ctype); narrower ones use int32.
    doc = torch.sort(torch.randint(0, 4, (2, 170), generator=torch.Generator().manual_seed(4),
                                   dtype=dtype), dim=1).values

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    run_variant_case(Spec(64), RAGGED, {"mask_mod": mask_mod})


def test_prefix_lm_with_a_per_batch_length():
    prefix = torch.tensor([40, 0], dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    run_variant_case(Spec(64, version=1), Shape(2, 150, 150, heads=2, kv_heads=1), {"mask_mod": mask_mod})


@pytest.mark.parametrize("version", [1, 2])
def test_nonlinear_score_mod(version):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(score)

    run_variant_case(Spec(64, version=version, dropout=True), RAGGED, {"score_mod": score_mod})


def test_modulo_in_a_score_mod_is_python_floor_modulo():
    """`%` on an index beside a float factor (C binds `0.25F*kv_idx % 5` wrongly), and on a float
    that is negative as often as not (C's fmod keeps the numerator's sign, Python's % the divisor's).
    The float stays 0.1 from the multiples of 0.75, where fp32 and float64 could floor apart."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.25 * (kv_idx % 5) - ((q_idx - kv_idx) * 0.25 + 0.1) % 0.75

    run_variant_case(Spec(64), RAGGED, {"score_mod": score_mod})


# -- tiles visited against the dense mask -----------------------------------------------------------

def _dense_tiles(spec: Spec, q, k, v, variant, seqlens_k):
    """Per launch slot (as the debug counter records it), the K/V tiles with a visible pair."""
    prob = make_problem(q, k, v, causal=spec.causal, seqlens_k=seqlens_k,
                        **{n: x for n, x in variant.items() if n in ("window_size", "mask_mod")})
    visible = prob.visible_all().expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    blocks = -(-q.shape[1] // spec.block_m)
    counts = torch.zeros(q.shape[0], q.shape[2], blocks, dtype=torch.int32)
    for q_block in range(blocks):
        slot = blocks - 1 - q_block if spec.causal else q_block
        rows = visible[:, :, q_block * spec.block_m:(q_block + 1) * spec.block_m]
        for first in range(0, k.shape[1], spec.block_n):
            counts[:, :, slot] += rows[..., first:first + spec.block_n].flatten(2).any(-1).int()
    return counts


TILE_CASES = {
    "window": (Spec(64, block_m=64, block_n=32, num_warps=4), {"window_size": (20, 7)}),
    "window_causal_padding": (Spec(64, block_m=64, block_n=32, num_warps=4, mask="causal", key_padding=True),
                              {"window_size": (50, -1)}),
    "right_only": (Spec(64, block_m=64, block_n=32, num_warps=4), {"window_size": (-1, 10)}),
    "prefix_lm": (Spec(64, block_m=64, block_n=32, num_warps=4),
                  {"mask_mod": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < PREFIX[b])}),
    "documents": (Spec(64, block_m=64, block_n=32, num_warps=4),
                  {"mask_mod": lambda b, h, q_idx, kv_idx: DOCS[b, q_idx] == DOCS[b, kv_idx]}),
    "documents_causal": (Spec(64, block_m=64, block_n=32, num_warps=4, mask="causal"),
                         {"mask_mod": lambda b, h, q_idx, kv_idx: DOCS[b, q_idx] == DOCS[b, kv_idx]}),
    "documents_int64_causal_padding": (Spec(64, block_m=64, block_n=32, num_warps=4, mask="causal",
                                            key_padding=True),
                                       {"mask_mod": lambda b, h, q_idx, kv_idx: DOCS64[b, q_idx] == DOCS64[b, kv_idx]}),
}
PREFIX = torch.tensor([70, 3], dtype=torch.int32)
# Packed documents of uneven lengths (one longer than a tile, several shorter), sorted ids.
DOCS = torch.tensor([[0] * 130 + [1] * 7 + [2] * 90 + [3] * 400, [5] * 20 + [6] * 300 + [7] * 307], dtype=torch.int32)
DOCS64 = DOCS.long() * 2**33   # ids past int32: 64-bit summaries


@pytest.mark.parametrize("shape", [Shape(2, 300, 333), Shape(2, 257, 100), Shape(2, 64, 500)], ids=str)
@pytest.mark.parametrize("case", TILE_CASES)
def test_tiles_visited_equal_the_dense_count(case, shape):
    base, variant = TILE_CASES[case]
    q, k, v, _, seqlens_k = make_inputs(base, shape, lengths=[shape.seqlen_k, shape.seqlen_k // 3])
    spec, call = variant_spec(base, q, k, variant)
    blocks = -(-shape.seqlen_q // spec.block_m)
    visited = torch.full((shape.batch * shape.heads * blocks,), -1, dtype=torch.int32)
    attention_kernels.forward(render(spec, debug=True), q, k, v, seqlens_k=seqlens_k, variant_values=call.values,
                              debug={"tiles_visited": visited})
    expected = _dense_tiles(spec, q, k, v, variant, seqlens_k)
    assert torch.equal(visited.view(shape.batch, shape.heads, blocks), expected)
