"""Every entry point under torch.compile(fullgraph=True) (issue 26, section 1): 0 graph breaks
(torch._dynamo.explain), and forward and backward bit-identical to eager on the emulator.

flash_attn_with_kvcache has its own file (test_kvcache_compile.py). A mod's closure constants
and captured tensors are graph values: a new closure neither re-renders the kernels nor makes
Dynamo recompile on every call (test_a_new_closure_is_neither_a_new_kernel_nor_a_recompile).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fagen
from fagen.ops import call

GEN = torch.Generator().manual_seed(70)


def _inputs(*shape, grad=True):
    return tuple(torch.randn(*shape, generator=GEN).half().requires_grad_(grad) for _ in range(3))


def _grads(outputs, inputs):
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    return torch.autograd.grad(first.float().square().sum(), inputs)


def _check(step, args, wrt, seed=None):
    """0 graph breaks, and the compiled outputs and gradients equal eager's bit for bit (with
    `seed`, torch's generator is reset before each run: dropout draws its Philox pair from it)."""
    explained = torch._dynamo.explain(step)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        if seed is not None:
            torch.manual_seed(seed)
        outputs = fn(*args)
        runs.append((outputs if isinstance(outputs, tuple) else (outputs,), _grads(outputs, wrt)))
    (eager, eager_grads), (compiled, compiled_grads) = runs
    for a, b in zip(eager + eager_grads, compiled + compiled_grads):
        assert torch.equal(a, b)


# -- flash_attn_func with every feature ---------------------------------------------------------

BIAS = torch.randn(32, generator=GEN).half().requires_grad_()
SINKS = torch.randn(2, generator=GEN).requires_grad_()
SLOPES = torch.tensor([0.5, 0.25])
LENGTHS = torch.tensor([20, 32], dtype=torch.int32)


def _biased(bias, scale):
    """A score_mod closure made outside the compiled function, as FlexAttention's examples do."""
    return lambda score, b, h, q_idx, kv_idx: score * scale + bias[kv_idx]


def every_third(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 3 != 1


FEATURES = {
    "window": dict(causal=True, window_size=(8, 0)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(causal=True, alibi_slopes=SLOPES),
    "sinks": dict(causal=True, sinks=SINKS),
    "score_mod with a captured tensor": dict(score_mod=_biased(BIAS, 0.5)),
    "mask_mod": dict(mask_mod=every_third),
    "seqlens_k": dict(causal=True, seqlens_k=LENGTHS),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_flash_attn_func(feature):
    q, k, v = _inputs(2, 32, 2, 64)
    kwargs = FEATURES[feature]
    captured = [t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    if feature.startswith("score_mod"):
        captured.append(BIAS)
    _check(lambda q, k, v: fagen.flash_attn_func(q, k, v, **kwargs), (q, k, v), (q, k, v, *captured))


def test_a_mod_of_its_arguments_written_inside_the_compiled_function():
    q, k, v = _inputs(1, 32, 2, 64)
    _check(lambda q, k, v: fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.1),
           (q, k, v), (q, k, v))


# A mod written inside the compiled function that reads a tensor: a global, a closure cell (an
# argument, or a tensor computed in the function), a module's parameter. Dynamo does not let fagen read such a function's globals or closure, so
# fagen records the mod as Dynamo traces it (fagen/variants/recording.py): the tensor is a graph
# input. One expression (one kernel) for the three.
HEAD_BIAS = torch.randn(2, 32, generator=GEN).half().requires_grad_()


def _reads_a_global(q, k, v):
    return fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s + HEAD_BIAS[h, j])


def _reads_a_closure(q, k, v, bias):
    return fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h, j])


def _reads_a_tensor_it_computed(q, k, v, bias):
    doubled = bias * 2   # a closure cell holding a graph value: its gradient flows on to bias
    return fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s + doubled[h, j])


class HeadBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(2, 32, generator=GEN).half())

    def forward(self, q, k, v):
        return fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s + self.bias[h, j])


def _forms():
    """(the step, its extra arguments, the tensor its mod reads) of each form."""
    bias, module = torch.randn(2, 32, generator=GEN).half().requires_grad_(), HeadBias()
    return {"a global": (_reads_a_global, (), HEAD_BIAS), "a closure": (_reads_a_closure, (bias,), bias),
            "a tensor computed inside": (_reads_a_tensor_it_computed, (bias,), bias),
            "self.bias": (module, (), module.bias)}


@pytest.mark.parametrize("form", ["a global", "a closure", "a tensor computed inside", "self.bias"])
def test_a_mod_written_inside_the_compiled_function_reads_its_tensors_as_graph_inputs(form):
    """fullgraph with 0 graph breaks, outputs and gradients (the read tensor's too) equal to
    eager's bit for bit, and new values of the read tensor run the same graph (no recompile)."""
    step, extra, bias = _forms()[form]
    q, k, v = _inputs(1, 32, 2, 64)
    explained = torch._dynamo.explain(step)(q, k, v, *extra)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=compiles)
    for _ in range(2):
        eager, traced = step(q, k, v, *extra), compiled(q, k, v, *extra)
        assert torch.equal(eager, traced)
        for a, b in zip(_grads(eager, (q, k, v, bias)), _grads(traced, (q, k, v, bias))):
            assert torch.equal(a, b)
        with torch.no_grad():   # new values: still the one graph
            bias.add_(torch.randn(bias.shape, generator=GEN).half())
    assert compiles.frame_count == 1


def test_dropout_and_return_lse():
    q, k, v = _inputs(1, 32, 2, 64)
    _check(lambda q, k, v: fagen.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_lse=True),
           (q, k, v), (q, k, v), seed=7)


def test_flash_attn_varlen_func():
    q, k, v = _inputs(40, 2, 64)
    cu = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
    _check(lambda q, k, v: fagen.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True), (q, k, v), (q, k, v))


def test_merge_attention():
    outs = torch.randn(3, 2, 8, 2, 16, generator=GEN).requires_grad_()
    lses = torch.randn(3, 2, 2, 8, generator=GEN).requires_grad_()
    _check(lambda o, s: fagen.merge_attention(o, s), (outs, lses), (outs, lses))


# -- fagen.sdpa and fagen.flex_attention (B, H, N, d) ----------------------------------------------

MASK = torch.rand(2, 1, 16, 16, generator=GEN) > 0.3
PADDING = torch.arange(16)[None, None, None, :] < torch.tensor([10, 16])[:, None, None, None]
SDPA = {
    "is_causal": dict(is_causal=True),
    "a boolean mask": dict(attn_mask=MASK),
    "key padding": dict(attn_mask=PADDING),   # eagerly seqlens_k, compiled a mask_mod: the same result
    "a float mask": dict(attn_mask=torch.randn(1, 2, 16, 16, generator=GEN)),
}


@pytest.mark.parametrize("case", SDPA)
def test_sdpa(case):
    q, k, v = _inputs(2, 2, 16, 64)
    _check(lambda q, k, v: fagen.sdpa(q, k, v, **SDPA[case]), (q, k, v), (q, k, v))


def test_sdpa_top_left_causal():
    q = _inputs(2, 2, 12, 64)[0]
    k, v = _inputs(2, 2, 16, 64)[:2]
    _check(lambda q, k, v: fagen.sdpa(q, k, v, is_causal=True), (q, k, v), (q, k, v))


def test_flex_attention_with_a_block_table():
    """A BlockMask of noop_mask with blocks left out runs as its block table (a partial)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _inputs(1, 2, 16, 64)
    lower = create_block_mask(lambda b, h, i, j: i >= j, None, None, 16, 16, device="cpu", BLOCK_SIZE=8)
    table = lower._adjust(16, 16) if hasattr(lower, "_adjust") else lower
    table.mask_mod = torch.nn.attention.flex_attention.noop_mask
    _check(lambda q, k, v: fagen.flex_attention(q, k, v, block_mask=table), (q, k, v), (q, k, v))


def test_flex_attention_with_a_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _inputs(2, 2, 16, 64)
    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 16, 16, device="cpu")
    _check(lambda q, k, v: fagen.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.1,
                                                block_mask=block_mask), (q, k, v), (q, k, v))


# -- free values: a new closure is a new value, not a new kernel --------------------------------

def test_a_new_closure_is_neither_a_new_kernel_nor_a_recompile():
    """Three closures of one mod (another constant, another captured tensor each time): one
    Spec, and Dynamo compiles at most twice (the first changed constant turns it dynamic)."""
    q, k, v = _inputs(1, 32, 2, 64, grad=False)
    compiled = torch.compile(lambda q, k, v, mod: fagen.flash_attn_func(q, k, v, score_mod=mod), fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    specs_before = call._spec_of.cache_info().misses
    for scale in (0.5, 0.25, 2.0, 3.0):
        mod = _biased(torch.randn(32, generator=GEN).half(), scale)
        assert torch.equal(compiled(q, k, v, mod), fagen.flash_attn_func(q, k, v, score_mod=mod))
    assert call._spec_of.cache_info().misses - specs_before <= 1
    assert counters["stats"]["unique_graphs"] <= 2


# -- ring attention's per-step ops (fagen.distributed.ring_ops) ------------------------------------

@pytest.mark.parametrize("window", [None, (5, 0)], ids=["causal", "causal window"])
def test_a_ring_step_forward_and_backward(window):
    """One rank's steps (world 1: the pairs of a zigzag shard, their merge, then the pairs'
    backward) trace as the pair ops and merge_attention, with no graph break."""
    from fagen.distributed.ring import RingCall, _backward, _forward

    q, k, v = _inputs(1, 32, 2, 64, grad=False)
    dout = torch.randn(1, 32, 2, 64, generator=GEN).half()
    call = RingCall(None, 1, 0, "zigzag", True, 0.0, 0.125, False, 16, (0, 0), window=window)

    def step(q, k, v, dout):
        out, lse = _forward(q, k, v, call)
        return (out, lse, *_backward(q, k, v, out, lse, dout, call))

    explained = torch._dynamo.explain(step)(q, k, v, dout)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, dout)
    for a, b in zip(step(q, k, v, dout), compiled):
        assert torch.equal(a, b)
