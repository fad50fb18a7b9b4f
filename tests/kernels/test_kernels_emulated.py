"""The generated tensor-core kernels, run on the CPU by the SIMT emulator.

Every combination of version x mask x dropout x dtype x head dim is run,
forward and backward, against the float64 oracle under FlashAttention-2's
tolerance rule (tests/support/kernel_cases.py). The shapes follow a covering design:
within each head dim the cases cycle through the six shapes, shifted by the
head dim's position, so that every (version, head dim) meets a ragged shape,
Nq = 1, Nq != Nk, MQA, GQA and (with key padding) an entry with no keys;
test_the_matrix_covers_every_property_per_head_dim holds it to that.
"""

import itertools

import pytest
import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.reference import dropout_keep_mask
from fagen.spec import Spec
import kernel_checks as checks
from kernel_cases import OFFSET, SEED, Shape, key_lengths, make_inputs, run_and_check

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

RAGGED = [Shape(2, 128, 128), Shape(1, 17, 200), Shape(2, 200, 17), Shape(1, 1, 77),
          Shape(2, 130, 130, heads=4, kv_heads=1), Shape(1, 96, 64, heads=4, kv_heads=2)]
MASKS = {"none": {}, "causal": {"mask": "causal"}, "padding": {"key_padding": True}}
HEAD_DIMS = (32, 64, 128, 256)
CASES_PER_HEAD_DIM = list(itertools.product((1, 2), MASKS, (False, True), ("fp16", "bf16")))
MATRIX = [(*case, head_dim) for case in CASES_PER_HEAD_DIM for head_dim in HEAD_DIMS]


def matrix_shape(version, mask, dropout, dtype, head_dim) -> Shape:
    """The covering design: the case's position among its head dim's cases, shifted by the
    head dim's position, picks the shape (each head dim meets every shape four times, twice
    per version, and with key padding at least two of the batch-2 shapes)."""
    position = CASES_PER_HEAD_DIM.index((version, mask, dropout, dtype))
    return RAGGED[(position + HEAD_DIMS.index(head_dim)) % len(RAGGED)]


def shape_properties(spec: Spec, shape: Shape) -> set[str]:
    met = {"ragged"} if shape.seqlen_q % 16 or shape.seqlen_k % 16 else set()
    met |= {"Nq = 1"} if shape.seqlen_q == 1 else set()
    met |= {"Nq != Nk"} if shape.seqlen_q != shape.seqlen_k else set()
    met |= {"MQA"} if shape.kv_heads == 1 < shape.heads else set()
    met |= {"GQA"} if 1 < shape.kv_heads < shape.heads else set()
    met |= {"empty padded entry"} if spec.key_padding and 0 in key_lengths(spec, shape) else set()
    return met


def matrix_spec(version, mask, dropout, dtype, head_dim) -> Spec:
    return Spec(head_dim=head_dim, version=version, dtype=dtype, dropout=dropout, **MASKS[mask])


# forward: warps advance in lockstep; warp-serial-reverse: the last warp runs a whole barrier
# interval before the others, which exposes a missing barrier between reading a shared
# tile and refilling it (fagen/emulate/README.md).
SCHEDULES = ("forward", "warp-serial-reverse")


PROPERTIES = {"ragged", "Nq = 1", "Nq != Nk", "MQA", "GQA", "empty padded entry"}


def default_tier_cases() -> set[tuple]:
    """Half the matrix, still a covering design: per (version, head dim), one dtype for each
    (mask, dropout) cell, fp16 in three cells and bf16 in three, the first such choice whose
    shapes meet every property (the slow tier runs the other half)."""
    chosen = set()
    cells = list(itertools.product(MASKS, (False, True)))
    for version, head_dim in itertools.product((1, 2), HEAD_DIMS):
        for dtypes in itertools.product(("fp16", "bf16"), repeat=len(cells)):
            cases = [(version, mask, dropout, dtype, head_dim) for (mask, dropout), dtype in zip(cells, dtypes)]
            met = set().union(*(shape_properties(matrix_spec(*case), matrix_shape(*case)) for case in cases))
            if dtypes.count("fp16") == len(cells) // 2 and met >= PROPERTIES:
                chosen.update(cases)
                break
        else:
            raise AssertionError(f"no balanced half of v{version} d{head_dim}'s cases meets every property")
    return chosen


# The default tier runs its half of the matrix under `forward`, and that half's d = 64 rows under
# warp-serial-reverse too (the slow tier: every row under both); the racecheck tests
# (test_kernels_racecheck.py) see every shared-memory access of the kernels besides.
DEFAULT_CASES = default_tier_cases()
MATRIX_RUNS = [pytest.param(schedule, *case, id=f"{'-'.join(map(str, case))}-{schedule}",
                            marks=() if case in DEFAULT_CASES and (schedule == "forward" or case[-1] == 64)
                            else pytest.mark.slow)
               for case in MATRIX for schedule in SCHEDULES]


@pytest.mark.parametrize("schedule, version, mask, dropout, dtype, head_dim", MATRIX_RUNS)
def test_kernel_matrix(version, mask, dropout, dtype, head_dim, schedule, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    case = (version, mask, dropout, dtype, head_dim)
    run_and_check(matrix_spec(*case), matrix_shape(*case))


@pytest.mark.parametrize("tier, cases", [("slow", MATRIX), ("default", sorted(DEFAULT_CASES))])
def test_the_matrix_covers_every_property_per_head_dim(tier, cases):
    assert tier == "slow" or (len(cases) == len(MATRIX) // 2 and {case[3] for case in cases} == {"fp16", "bf16"})
    for version, head_dim in itertools.product((1, 2), HEAD_DIMS):
        mine = [case for case in cases if case[0] == version and case[-1] == head_dim]
        assert {case[1:3] for case in mine} == set(itertools.product(MASKS, (False, True)))
        met = set().union(*(shape_properties(matrix_spec(*case), matrix_shape(*case)) for case in mine))
        assert met >= PROPERTIES, f"{tier} tier: v{version} d{head_dim} never meets {sorted(PROPERTIES - met)}"


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 17), (128, 128), (200, 200), (70, 250),
                                                (250, 70)])
@pytest.mark.parametrize("version", [1, 2])
def test_ragged_causal_sizes(version, seqlen_q, seqlen_k):
    run_and_check(Spec(64, version=version, mask="causal"), Shape(1, seqlen_q, seqlen_k))


@pytest.mark.parametrize("head_dim", [96, 160, 192, 40])
def test_other_head_dims(head_dim):
    run_and_check(Spec(head_dim, mask="causal", dtype="bf16"), Shape(1, 90, 70, heads=2, kv_heads=1))


@pytest.mark.parametrize("version", [1, 2])
def test_gqa_and_mqa(version):
    run_and_check(Spec(64, version=version), Shape(2, 64, 80, heads=6, kv_heads=3))
    run_and_check(Spec(64, version=version, mask="causal"), Shape(1, 64, 80, heads=4, kv_heads=1))


# V's head dim below Q's (Spec.head_dim_v): O, dO and dV have d_v columns, dQ and dK d. Each
# case meets a different mask, dropout, the deterministic dQ kernel, GQA/MQA and a schedule.
HEAD_DIM_V_CASES = [
    (Spec(192, head_dim_v=128, mask="causal", key_padding=True, dropout=True, dtype="bf16"),
     Shape(2, 70, 90, heads=4, kv_heads=2), "warp-serial-reverse"),
    (Spec(192, head_dim_v=128, deterministic=True), Shape(1, 50, 40, heads=2, kv_heads=1), "forward"),
    (Spec(128, head_dim_v=64, mask="causal"), Shape(1, 96, 64, heads=4, kv_heads=2), "warp-serial-reverse"),
    (Spec(128, head_dim_v=64, key_padding=True, dropout=True, deterministic=True), Shape(2, 33, 77), "forward"),
    (Spec(40, head_dim_v=24, mask="causal", dropout=True), Shape(1, 17, 70, heads=2, kv_heads=1), "forward"),
]


@pytest.mark.parametrize("spec, shape, schedule", HEAD_DIM_V_CASES,
                         ids=[f"{s.name}-{shape}" for s, shape, _ in HEAD_DIM_V_CASES])
def test_head_dim_v_below_head_dim(spec, shape, schedule, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    run_and_check(spec, shape)


# Head dims past 256 (issue 27 item 2): pairs of warps split O's columns (Spec.column_split), and
# the deterministic dQ kernel's; the 99 KB parts' 32 x 16 forward and 16 x 16 backward tiles.
WIDE_HEAD_DIM_CASES = [
    (Spec(320, mask="causal", key_padding=True, dropout=True), Shape(2, 70, 90, heads=4, kv_heads=2),
     "warp-serial-reverse"),
    (Spec(384, head_dim_v=256, deterministic=True, dtype="bf16"), Shape(1, 40, 33, heads=2, kv_heads=1), "forward"),
    (Spec(448, mask="causal", block_m=32, block_n=16, num_warps=4, num_stages=1, bwd_block_n=16),
     Shape(1, 50, 20, heads=3, kv_heads=1), "warp-serial-reverse"),
    (Spec(512, mask="causal", deterministic=True, dropout=True), Shape(1, 70, 90, heads=2, kv_heads=1),
     "warp-serial-reverse"),
    (Spec(512, key_padding=True, block_m=32, block_n=16, num_warps=4, num_stages=1, bwd_block_n=16,
          deterministic=True), Shape(2, 37, 45), "forward"),
]


@pytest.mark.parametrize("spec, shape, schedule", WIDE_HEAD_DIM_CASES,
                         ids=[f"{s.name}-{shape}" for s, shape, _ in WIDE_HEAD_DIM_CASES])
def test_head_dims_past_256(spec, shape, schedule, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    run_and_check(spec, shape)


def test_gqa_gradients_are_rounded_once_after_the_group_sum():
    """A group's dK/dV parts are summed in fp32 and rounded once. Rounded per head first (as
    FlashAttention-2 does), this case's dV erred by 1.5 ulp at |dV| ~ 5.5: 3.1x PyTorch's error
    (found by the fuzz tier, FAGEN_FUZZ_SEED=2159872827)."""
    spec = Spec(40, mask="causal", key_padding=True, block_m=128, block_n=32, num_warps=4, num_stages=2,
                bwd_stages=3, bwd_block_n=128)
    run_and_check(spec, Shape(2, 110, 58, heads=3, kv_heads=1))


@pytest.mark.parametrize("version", [1, 2])
def test_deterministic_backward_is_correct_and_bit_identical(version):
    """Repeats in opposite block orders (tests/kernels/test_kernels_determinism.py has the positive
    control: the atomic variant fails the same check)."""
    spec = Spec(64, version=version, mask="causal", deterministic=True, dropout=True)
    run_and_check(spec, Shape(1, 150, 150, heads=2, kv_heads=1))
    checks.repeat_check(spec)


def test_causal_skips_masked_tiles_and_launches_the_heaviest_blocks_first():
    """FA-2 visits only K/V tiles left of each query block's diagonal, and the block in
    launch slot s is query block (blocks - 1 - s), so the heaviest start first."""
    spec = Spec(64, mask="causal", block_m=64, block_n=32)
    source = render(spec, debug=True)
    for seqlen_q, seqlen_k in [(256, 256), (100, 300), (300, 100)]:
        q, k, v, _, _ = make_inputs(spec, Shape(1, seqlen_q, seqlen_k, heads=1, kv_heads=1))
        blocks = -(-seqlen_q // 64)
        visited = torch.full((blocks,), -1, dtype=torch.int32)
        attention_kernels.forward(source, q, k, v, debug={"tiles_visited": visited})  # by launch slot
        # Block i's last row is 64(i+1) - 1; it sees keys j <= 64(i+1) - 1 + Nk - Nq.
        by_block = [max(0, min(seqlen_k, 64 * (i + 1) + seqlen_k - seqlen_q) + 31) // 32
                    for i in range(blocks)]
        assert visited.tolist() == by_block[::-1]
        assert visited.tolist() == sorted(visited.tolist(), reverse=True)
        full = -(-seqlen_k // 32)
        assert sum(by_block) < blocks * full  # something was skipped


def test_without_causal_blocks_launch_in_order():
    spec = Spec(64, block_m=64, block_n=32, key_padding=True)
    source = render(spec, debug=True)
    q, k, v, _, _ = make_inputs(spec, Shape(2, 200, 90, heads=1, kv_heads=1))
    visited = torch.full((2 * 4,), -1, dtype=torch.int32)
    attention_kernels.forward(source, q, k, v, seqlens_k=torch.tensor([90, 40], dtype=torch.int32),
                              debug={"tiles_visited": visited})
    assert visited.tolist() == [3] * 4 + [2] * 4   # (batch, head, slot): every block sees its keys


def test_fa1_causal_skips_masked_pairs():
    spec = Spec(64, version=1, mask="causal", block_m=64, block_n=64)
    source = render(spec, debug=True)
    q, k, v, _, _ = make_inputs(spec, Shape(1, 256, 256, heads=1, kv_heads=1))
    visited = torch.full((1,), -1, dtype=torch.int32)
    attention_kernels.forward(source, q, k, v, debug={"tiles_visited": visited})
    assert visited.item() == 4 + 3 + 2 + 1  # K/V block j meets Q blocks j..3


@pytest.mark.parametrize("version", [1, 2])
def test_dropout_mask_is_philox_forward_and_backward(version):
    spec = Spec(64, version=version, dropout=True, mask="causal")
    shape = Shape(2, 70, 90, heads=2, kv_heads=1)
    q, k, v, dout, _ = make_inputs(spec, shape)
    source = render(spec, debug=True)
    mask_shape = (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)
    fwd_mask = torch.full(mask_shape, 7, dtype=torch.uint8)
    bwd_mask = torch.full(mask_shape, 7, dtype=torch.uint8)
    debug = {"tiles_visited": torch.zeros(64, dtype=torch.int32), "keep_mask": fwd_mask}
    out, stats = attention_kernels.forward(source, q, k, v, dropout_p=0.4, seed=SEED, philox_offset=OFFSET, debug=debug)
    attention_kernels.backward(source, q, k, v, out, stats, dout,
                               dropout_args=attention_kernels.dropout_args(0.4, SEED, OFFSET),
                               debug={"keep_mask": bwd_mask})
    expected = dropout_keep_mask(SEED, OFFSET, *mask_shape, 0.4).to(torch.uint8)
    visible = torch.ones(shape.seqlen_q, shape.seqlen_k, dtype=torch.bool).tril(shape.seqlen_k - shape.seqlen_q)
    # Kernels draw bits only for tiles they visit; every visible element must match.
    assert torch.equal(fwd_mask[..., visible], expected[..., visible])
    assert torch.equal(bwd_mask[..., visible], expected[..., visible])
    kept = expected[..., visible].float().mean().item()
    assert abs(kept - 0.6) < 0.03


@pytest.mark.parametrize("num_stages", [1, 3])
@pytest.mark.parametrize("version", [1, 2])
def test_pipeline_depths_with_blocks_that_see_no_key(version, num_stages):
    """Other copy-pipeline depths (the tuning grid has 1-3; Hopper's fallback uses 3), on a
    shape whose first query blocks see no key at all (causal, Nq > Nk)."""
    spec = Spec(64, version=version, mask="causal", block_m=64, block_n=32, num_stages=num_stages)
    run_and_check(spec, Shape(1, 300, 40, heads=2, kv_heads=1))
    run_and_check(spec.replace(key_padding=True, mask="none"), Shape(2, 70, 90))


def fallback_variants() -> list[tuple[Spec, str]]:
    """The tiles untuned calls run with, one variant per distinct tiling over the arch
    families (sm_80, the 99 KB parts, Hopper)."""
    from fagen.tuning import fallback_spec

    found: dict[Spec, str] = {}
    for arch in ("sm_80", "sm_86", "sm_90"):
        for head_dim in (64, 128):
            found.setdefault(fallback_spec(Spec(head_dim, mask="causal", dropout=True), arch), arch)
    return list(found.items())


@pytest.mark.parametrize(("spec", "arch"), fallback_variants(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_fallback_tiles_of_each_arch_class(spec, arch):
    """Each arch class's fallback tiles (Hopper's 128 x 128 at d=128, three stages at d=64,
    the 99 KB parts' half-height K/V tiles) on a ragged causal shape with several K/V blocks."""
    run_and_check(spec, Shape(1, 150, 270, heads=2, kv_heads=1))


@pytest.mark.parametrize("version", [1, 2])
def test_single_stage_backward_of_99kb_parts(version):
    """d=128 with one Q/dO stage (what sm_86/89/120 run), with every flag that touches the
    backward, and its deterministic dQ kernel with one K/V stage."""
    spec = Spec(128, version=version, block_n=32, bwd_stages=1, mask="causal", key_padding=True,
                dropout=True)
    run_and_check(spec, Shape(2, 150, 170, heads=2, kv_heads=1))
    run_and_check(spec.replace(deterministic=True, key_padding=False), Shape(1, 90, 130))


def test_three_stage_backward():
    """A deeper Q/dO pipeline than the table's (the depth is a spec knob)."""
    spec = Spec(64, mask="causal", bwd_stages=3, key_padding=True)
    run_and_check(spec, Shape(2, 300, 200))
    run_and_check(spec.replace(deterministic=True), Shape(1, 200, 300))
