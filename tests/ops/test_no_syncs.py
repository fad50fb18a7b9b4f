"""No device-to-host sync in a warm hot path (issue 26, section 3).

Each call runs once (compiling, loading, remembering what a first call may), then again with the
Tensor methods a sync goes through refused (tests/support/host_reads.py): a decoding step, packed
sequences with max_seqlen given (forward and backward), the transformers attention function
(plain, padded, packed by cu_seq_lens and by position_ids) and flash_attn_func with seqlens_k.
ring_attention's second call is checked in tests/distributed/test_distributed.py's workers.
"""

import pytest
import torch

import fagen
from host_reads import no_host_reads
from kvcache_cases import Case, rotary_tables


def _twice(call):
    """The call warm, then refused every host read: it must run, and give what it gave."""
    first = call()
    with no_host_reads():
        second = call()
    return first, second


def test_the_refused_reads_are_refused():
    t = torch.tensor([1, 2])
    with no_host_reads():
        for read in (lambda: t.tolist(), lambda: bool(t[0]), lambda: int(t[0]), lambda: t.nonzero(), t.cpu):
            with pytest.raises(AssertionError, match="a device-to-host sync"):
                read()
    assert t.tolist() == [1, 2] and int(t[0]) == 1


@pytest.mark.parametrize("page", [16, None], ids=["paged", "contiguous"])
def test_a_decoding_step(page):
    """Append, rotary, split-KV and combine; the appended rows land where they did."""
    layout = dict(page=page) if page else dict(batch_idx=True, leftpad=True)
    cases = [Case(nq=1, new=1, seed=50, **layout) for _ in range(2)]
    cos, sin = rotary_tables(cases[0].capacity, 32, cases[0].dtype)
    calls = iter(cases)

    def step():
        case = next(calls)
        return fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, rotary_cos=cos, rotary_sin=sin,
                                             causal=True, num_splits=2, return_softmax_lse=True, **case.kwargs())

    (out, lse), (out2, lse2) = _twice(step)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and torch.equal(cases[0].k_cache, cases[1].k_cache)


def test_packed_sequences_with_max_seqlen_given_forward_and_backward():
    gen = torch.Generator().manual_seed(51)
    q, k, v = (torch.randn(40, 2, 64, generator=gen).half().requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 17, 17, 40], dtype=torch.int32)

    def call():
        out = fagen.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True)
        return (out, *torch.autograd.grad(out.float().sum(), (q, k, v)))

    for first, second in zip(*_twice(call)):
        assert torch.equal(first, second)


def test_seqlens_k():
    gen = torch.Generator().manual_seed(52)
    q, k, v = (torch.randn(2, 16, 2, 64, generator=gen).half() for _ in range(3))
    lengths = torch.tensor([9, 16], dtype=torch.int32)
    first, second = _twice(lambda: fagen.flash_attn_func(q, k, v, causal=True, seqlens_k=lengths))
    assert torch.equal(first, second)


# -- the transformers attention function --------------------------------------------------------

def _layer_inputs(batch=2, length=12, heads=4, kv_heads=2):
    gen = torch.Generator().manual_seed(53)
    query = torch.randn(batch, heads, length, 64, generator=gen).half()
    key, value = (torch.randn(batch, kv_heads, length, 64, generator=gen).half() for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = True
    return module, query, key, value


@pytest.mark.parametrize("how", ["plain", "padded", "packed by cu_seq_lens", "packed by position_ids"])
def test_the_transformers_attention_function(how):
    pytest.importorskip("transformers")
    from fagen.integrations.transformers import attention_forward

    batch = 2 if how == "padded" else 1   # plain: one row with position_ids 0 .. N - 1, as generate passes
    module, query, key, value = _layer_inputs(batch)
    mask, extra = None, {}
    if how == "padded":   # left padding and right padding
        mask = torch.ones(2, 12, dtype=torch.int64)
        mask[0, :5] = 0
        mask[1, 9:] = 0
    elif how == "packed by cu_seq_lens":
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    elif how == "packed by position_ids":
        extra = dict(position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None])
    else:
        extra = dict(position_ids=torch.arange(12)[None])
    first, second = _twice(lambda: attention_forward(module, query, key, value, mask, **extra)[0])
    assert torch.equal(first, second)


def test_the_gpu_checks_captured_decoding_step_runs_on_the_emulator(monkeypatch):
    """tests/gpu/test_gpu_decode.py's CUDA-graph test with its capture and replay emulated (a replay
    is the step run again with every host read refused): its logic must not fail on the scarce
    GPU for a reason the CPU could have caught (as tests/gpu/test_gpu_suite_emulated.py checks the
    others')."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "gpu" / "test_gpu_decode.py"   # another folder: by path
    loader = importlib.util.spec_from_file_location("gpu_decode_tests", path)
    gpu = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(gpu)

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    gpu.test_a_decoding_step_captured_in_a_cuda_graph_replays_new_lengths_as_eager()
