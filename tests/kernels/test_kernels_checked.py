"""The generated kernels under AddressSanitizer and UBSan (FAGEN_EMULATE_CHECKED=1).

The plain emulator runs kernels in the test process, where a read a little
past a tensor's end lands in some other allocation and goes unnoticed. The
checked build copies every tensor into a buffer of its exact size in a helper
process and poisons the dynamic shared memory past the launch's size, so any
out-of-bounds access (global, shared, or a per-thread array) and any
undefined behaviour stop the launch naming the block and thread. Ragged tails,
key padding with an empty entry, GQA, empty causal rows, odd head dims,
deep and single-stage pipelines: the shapes where an index goes wrong.
"""

import dataclasses

import pytest
import torch

from fagen.kernels import attention_kernels
from fagen.kernels import launch
from fagen.kernels.render import render
from fagen.emulate import EmulationError
from fagen.spec import Spec
from kernel_cases import Shape, poisoned_empty, run_and_check

CASES = [
    (Spec(64, mask="causal", key_padding=True, dropout=True), Shape(2, 70, 90, heads=2, kv_heads=1)),
    (Spec(64, version=1, mask="causal", key_padding=True, dropout=True), Shape(3, 70, 90, heads=2, kv_heads=1)),
    (Spec(128, mask="causal", deterministic=True, dropout=True), Shape(1, 45, 77)),
    (Spec(128, version=1, key_padding=True, deterministic=True), Shape(2, 33, 51, heads=2, kv_heads=1)),
    (Spec(256, mask="causal", dtype="bf16"), Shape(1, 40, 20, heads=1, kv_heads=1)),
    (Spec(40, block_m=32, block_n=16, num_warps=2, num_stages=3, bwd_stages=3), Shape(1, 37, 29, heads=3, kv_heads=1)),
    (Spec(24, version=1, block_m=16, block_n=32, num_warps=1, num_stages=1, dtype="bf16", mask="causal"),
     Shape(2, 19, 5, heads=2, kv_heads=2)),
    (Spec(128, block_n=32, bwd_stages=1, mask="causal", dropout=True, key_padding=True), Shape(2, 50, 60)),
]


@pytest.fixture(autouse=True)
def checked(monkeypatch):
    monkeypatch.setenv(launch.CHECKED_ENV, "1")
    monkeypatch.setattr(attention_kernels, "_empty", poisoned_empty)


@pytest.mark.parametrize("spec, shape", CASES, ids=[f"{spec.name}-{shape}" for spec, shape in CASES])
def test_kernels_make_no_out_of_bounds_access(spec, shape):
    run_and_check(spec, shape)


def test_a_planted_out_of_bounds_write_is_caught():
    """The switch reaches the launch: the forward kernel with its L store moved one row on
    writes past the end of L, and the launch stops there."""
    source = render(Spec(64))
    store = "lse[((long long)batch * heads + head) * seqlen_q + row] ="
    assert store in source.code
    bad = dataclasses.replace(source, code=source.code.replace(
        store, "lse[((long long)batch * heads + head) * seqlen_q + row + 1] ="), pass_units=())
    q = torch.randn(1, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(EmulationError, match="heap-buffer-overflow"):
        attention_kernels.forward(bad, q, q, q)


def test_checked_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(launch.CHECKED_ENV, "yes")
    with pytest.raises(ValueError, match="FAGEN_EMULATE_CHECKED='yes'"):
        launch.emulate_checked()


def test_variant_mods_never_read_or_write_past_their_tensors():
    """Mods are evaluated on whole tiles, but the indices they see stay inside the sequence:
    a bias table and document ids sized exactly to the valid indices are neither read nor
    (the bias's gradient) written past their ends, under ASan, also for the ragged tiles."""
    import torch

    from variant_cases import run_variant_case

    nq, nk = 70, 90
    bias = (torch.randn(2, nq + nk - 1, generator=torch.Generator().manual_seed(5)) * 0.3).requires_grad_()
    doc = torch.tensor([[0] * 30 + [1] * (nk - 30), [2] * nk], dtype=torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + nk - 1]

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    shape = Shape(2, nq, nk, heads=2, kv_heads=1)
    run_variant_case(Spec(64, mask="causal"), shape, {"score_mod": score_mod, "mask_mod": mask_mod},
                     captures=(bias,))
    run_variant_case(Spec(64, version=1, mask="causal", deterministic=True), shape,
                     {"score_mod": lambda s, b, h, q_idx, kv_idx: s + bias.detach()[h, q_idx - kv_idx + nk - 1],
                      "mask_mod": mask_mod})
