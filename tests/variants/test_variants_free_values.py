"""A mod's free values (fagen/variants/free_values.py): the numbers and tensors it reads from its
closure, its globals, a partial's arguments and the functions it keeps (and_masks), lifted into
kernel arguments, so that a mod is traced, rendered and compiled once per structure."""

import functools

import pytest
import torch

import fagen
from fagen.kernels import render
from fagen.reference import attention_forward, attention_same_dtype
from fagen.variants.free_values import describe, rebuild
from fagen.variants.language import trace_mask_mod, trace_score_mod
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, max_error

GLOBAL_SCALE = 0.25
GLOBAL_BIAS = torch.linspace(-1, 1, 4)


def make_score(scale, bias, shift):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scale + bias[h] + GLOBAL_BIAS[h] * GLOBAL_SCALE - shift * (q_idx - kv_idx)
    return score_mod


def make_window(width):
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= width) & (kv_idx <= q_idx)
    return window


def both(*mods):
    def combined(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result
    return combined


def test_describe_and_rebuild_walk_the_free_values_in_one_order():
    inner = make_window(5)
    fn = functools.partial(both(inner, make_window(9)))
    signature, values = describe(make_score(0.5, torch.ones(4), 2))
    assert [type(v) for v in values] == [torch.Tensor, float, torch.Tensor, float, int]   # globals, then cells
    sentinels = [object() for _ in values]
    assert describe(rebuild(signature, sentinels))[1] == [] and \
        [c.cell_contents for c in rebuild(signature, sentinels).__closure__] == sentinels[2:]
    nested_signature, nested = describe(fn)
    assert nested == [5, 9]
    rebuilt = rebuild(nested_signature, [7, 11])
    assert describe(rebuilt)[1] == [7, 11] and describe(rebuilt)[0] == nested_signature


def test_closures_of_one_code_share_one_spec_and_one_render(monkeypatch):
    one = trace_score_mod(make_score(0.5, torch.ones(4), 2))
    two = trace_score_mod(make_score(-3.0, torch.zeros(4, dtype=torch.float32), 7))
    assert one.expr == two.expr and "par" in str(one.expr)
    renders = []
    real = render.render
    monkeypatch.setattr(render, "render", lambda *a, **k: renders.append(a[0]) or real(*a, **k))
    render.source_for.cache_clear()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 64, generator=gen).half() for _ in range(3))
    for scale, shift in ((0.5, 2), (0.3, 1), (1.5, 0)):
        bias = torch.randn(4, generator=gen)
        mod = make_score(scale, bias, shift)
        out = fagen.flash_attn_func(q, k, v, score_mod=mod)
        ref = attention_forward(q, k, v, score_mod=mod)[0]
        same = attention_same_dtype(q, k, v, torch.zeros_like(q), score_mod=mod)[0]
        assert max_error(out, ref) <= OUTPUT_FACTOR * max_error(same, ref) + ABS_FLOOR, (scale, shift)
    assert len(renders) == 1


def test_a_closure_integer_in_a_mask_is_an_argument_and_tiles_stay_decided():
    traced = trace_mask_mod(make_window(3))
    assert traced.params == ((0, "int"),) and "par0" in str(traced.expr)
    spec = fagen.Spec(64, mask_mod=fagen.variants.custom_mod(traced))
    code = render.render(spec).code
    assert "ctx.mask_par0" in code and "kPartialTile" in code
    # key_range reads the argument: the band's keys are found per block, not the whole row
    assert "key_range" in code and "ctx.mask_par0" in code.split("key_range(int b")[1].split("}")[0]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 150, 2, 64, generator=gen).half() for _ in range(3))
    for width in (3, 40):
        mod = make_window(width)
        out = fagen.flash_attn_func(q, k, v, mask_mod=mod)
        ref = attention_forward(q, k, v, mask_mod=mod)[0]
        same = attention_same_dtype(q, k, v, torch.zeros_like(q), mask_mod=mod)[0]
        assert max_error(out, ref) <= OUTPUT_FACTOR * max_error(same, ref) + ABS_FLOOR, width


def test_a_number_used_as_python_control_flow_is_baked():
    def make(flag_at):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + (1.0 if flag_at > 0 else -1.0)   # flag_at decides the structure
        return score_mod
    up, down = trace_score_mod(make(1)), trace_score_mod(make(0))
    assert up.params == () and up.baked == (1,) and str(up.expr) == "score + 1.0" and str(down.expr) == "score - 1.0"


def test_a_tensor_made_inside_the_mod_is_still_a_capture():
    traced = trace_score_mod(lambda s, b, h, q, k: s + torch.arange(4.0)[h])
    assert len(traced.tensors) == 1 and traced.capture_slots == (-1,)


@pytest.mark.parametrize("mod", [make_window(4), both(make_window(4), make_window(6))])
def test_rebuilt_combinations_trace_to_the_real_functions_expression(mod):
    signature, values = describe(mod)
    assert trace_mask_mod(rebuild(signature, values)).expr == trace_mask_mod(mod).expr


def test_a_lifted_number_inside_a_captures_index_is_renamed_with_it():
    """bias[h, q_idx - kv_idx + n]: the kernel reads `n` as its own argument (score_par0), also
    inside the capture's index (the renaming must reach into the load's arguments)."""
    from fagen.spec import Spec
    from fagen.variants.compose import custom_mod, mod_expression

    bias, n = torch.zeros(2, 9), 4
    traced = trace_score_mod(lambda s, b, h, q_idx, kv_idx: s + bias[h, q_idx - kv_idx + n])
    expr = mod_expression(custom_mod(traced), "score")
    assert {s.name for s in expr.free_symbols} >= {"score_par0"} and "par0" not in {s.name for s in expr.free_symbols}
    assert "ctx.score_par0" in render.render(Spec(64, score_mod=custom_mod(traced))).code
