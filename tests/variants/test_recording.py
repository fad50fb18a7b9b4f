"""A mod recorded as torch.compile traces it (fagen/variants/recording.py): where Dynamo does not
let fagen read a mod's closure or globals (a function made inside the compiled region) or the
mod keeps an object fagen cannot describe (a module). The record replays to the very expression
that the eager trace of the real function gives (so the same kernel runs), its captured tensors
are graph values, and what cannot be traced is refused with the eager trace's reason.

No kernel runs here: tests/ops/test_compile_native.py runs the recorded mods' kernels.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks

import fagen
from fagen.variants.free_values import describe
from fagen.variants.language import trace_mod, traced_structure
from fagen.variants.recording import record

GEN = torch.Generator().manual_seed(43)
BIAS = torch.randn(2, 16, generator=GEN).half()
TABLE = torch.arange(4, dtype=torch.int32)
DOCS = torch.tensor([[0, 0, 1, 1, 1, 2]], dtype=torch.int32)


def broad_score(bias, table):
    """Every kind of operation a score_mod may apply, reading its tensors from a closure."""
    def score_mod(s, b, h, i, j):
        x = (s * 0.5 + bias[h, j]) / 2 - 1.5
        x = 2 * x - x ** 2 + 1 / (1 + fagen.exp(-x)) - 3 * (1 - x)
        x = fagen.where(i >= j, x, -float("inf")) + torch.where(i != j, 0.25, s)
        x = torch.tanh(x) + x.sigmoid() + torch.clamp(x, min=-3.0) + fagen.minimum(x, 1.0) + fagen.maximum(-x, s)
        x = x + table[(i - j) % 4] + (i // 3 - j) * 0.25 + (2 - h) + torch.sqrt(torch.abs(x)) + x.exp().log()
        return -x
    return score_mod


def broad_mask(docs):
    def mask_mod(b, h, i, j):
        return ((i >= j) & ~(i - j > 8)) | (docs[b, i] == docs[b, j]) ^ (h == 1) | (i < 2) & (j <= 3)
    return mask_mod


def combined_mask(docs):
    """FlexAttention's and_masks over two lambdas: its own closure keeps them."""
    return and_masks(lambda b, h, i, j: i >= j, lambda b, h, i, j: docs[b, i] == docs[b, j])


class HeadBias(torch.nn.Module):
    """A module whose method is the mod: fagen cannot describe the module, Dynamo traces it."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(2, 16, generator=GEN))

    def score_mod(self, s, b, h, i, j):
        return s * 0.5 + self.bias[h, j]


MODULE = HeadBias()
MODS = {"score": (lambda: broad_score(BIAS, TABLE), "score"), "mask": (lambda: broad_mask(DOCS), "mask"),
        "and_masks": (lambda: combined_mask(DOCS), "mask"), "a module's method": (lambda: MODULE.score_mod, "score")}


def _expression(kind, signature):
    traced = traced_structure(kind, signature)
    assert traced is not None
    return traced.expr


@pytest.mark.parametrize("name", MODS)
def test_a_record_replays_to_the_eager_trace_of_the_real_function(name):
    make, kind = MODS[name]
    eager = trace_mod(kind, make())[0].expr
    signature, captures = record(make())   # eagerly: Tensor's dunder methods reach the mode
    assert _expression(kind, signature) == eager

    def step(x):   # the mod made inside the compiled function: Dynamo's own operation names
        signature, captures = describe(make())
        return x + 1, signature, captures

    _, compiled, compiled_captures = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(1))
    assert compiled[0] == "recorded" and _expression(kind, compiled) == eager
    assert len(compiled_captures) == len(captures) and all(
        torch.equal(a, b) for a, b in zip(compiled_captures, captures))


def test_a_mod_made_outside_is_described_not_recorded():
    """Dynamo reads a mod made outside the compiled function: its numbers stay lifted values."""
    mod = broad_score(BIAS, TABLE)

    def step(x):
        return x + 1, describe(mod)[0]

    assert torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(1))[1] == describe(mod)[0]


@pytest.mark.parametrize("make, reason", [
    (lambda: lambda s, b, h, i, j: s - abs(i - j), r"torch\.abs"),
    (lambda: lambda s, b, h, i, j: s + BIAS[h, :][j], "slice"),
    (lambda: lambda s, b, h, i, j: s + BIAS.double()[h, j], "float64"),
    (lambda: lambda s, b, h, i, j, extra: s + BIAS[h, j], "5 arguments"),
], ids=["abs", "a slice", "a float64 capture", "six arguments"])
def test_what_a_record_cannot_stand_for_is_refused_with_the_reason(make, reason):
    def step(x):   # the mod made inside the compiled function, so recorded
        return x + 1, describe(make())[0]

    with pytest.raises(Exception, match=reason):
        torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(1))


def test_what_the_tracer_refuses_a_record_replays_to_nothing():
    """An unsupported function is recorded, then refused on the replay as the eager trace
    refuses it: under torch.compile the call raises ModError."""
    def make():
        return lambda s, b, h, i, j: torch.erf(s)

    with pytest.raises(fagen.ModError, match="torch.erf"):
        trace_mod("score", make())

    def step(x):
        return x + 1, describe(make())[0]

    signature = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(1))[1]
    assert signature[0] == "recorded" and traced_structure("score", signature) is None
    q = torch.randn(1, 16, 2, 64, generator=GEN).half()
    with pytest.raises(Exception, match="ModError"):
        torch.compile(lambda q: fagen.flash_attn_func(q, q, q, score_mod=make()), fullgraph=True,
                      backend="eager")(q)
