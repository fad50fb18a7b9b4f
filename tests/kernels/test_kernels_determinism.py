"""Deterministic variants: no atomics, statically, and repeats that are bit-identical under
a block order built to reorder atomics, with a positive control that shows the repeat check
fails on the variant that uses them.

A deterministic variant (Spec(deterministic=True), flash-attn's deterministic=True) replaces
the backward's atomic dQ accumulation with a separate dQ pass. The check is static first:
every deterministic variant of the shipped set and of the sets the suite runs calls no atomic
in its source, and for a few the machine code has no RED/ATOM instruction (with the
non-deterministic variant, which has them, as the control). Then dynamic:
kernel_checks.repeat_check runs the backward with the emulator's blocks in opposite orders
(FAGEN_EMULATE_BLOCK_ORDER), which reorders float atomics into one dq element.
"""

import itertools

import pytest
import torch

import kernel_checks as checks
from fagen.kernels import attention_kernels
from fagen.kernels.build import default_specs
from fagen.kernels.render import Source, render
from fagen.kernels.compile import compile_source
from fagen.sass.listing import disassemble, find_cuobjdump
from fagen.arch import SMEM_LIMIT_BYTES
from fagen.spec import Spec
from fagen.tuning import fallback_spec
from fagen.tuning.space import DEFAULT_GRID
from kernel_cases import ATOMIC_CALL, Shape, make_inputs

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

HEAD_DIMS = (8, 16, 24, 32, 40, 64, 72, 96, 128, 136, 160, 192, 256)   # the fuzz's and the matrices'
FLAGS = [dict(zip(("version", "dtype", "mask", "key_padding", "dropout"), values))
         for values in itertools.product((1, 2), ("fp16", "bf16"), ("none", "causal"), (False, True),
                                         (False, True))]


def deterministic_variants() -> list[Spec]:
    """The shipped set (generated/) and every flag combination at every tested head dim, made
    deterministic; each arch's fallback tiles; every tile combination the tuner tries."""
    found = {s.replace(deterministic=True) for s in default_specs()}
    found |= {Spec(d, deterministic=True, **flags) for d in HEAD_DIMS for flags in FLAGS}
    base = Spec(64, mask="causal", key_padding=True, dropout=True, deterministic=True)
    found |= {fallback_spec(Spec(d, mask="causal", key_padding=True, dropout=True, deterministic=True), arch)
              for d in (64, 128, 256) for arch in SMEM_LIMIT_BYTES}
    for tiles in DEFAULT_GRID.combinations():
        try:
            found.add(base.replace(**tiles))
        except ValueError:   # not a legal variant
            continue
    return sorted(found, key=lambda s: s.name)


def test_no_deterministic_variant_calls_an_atomic():
    variants = deterministic_variants()
    assert len(variants) > 400
    for spec in variants:
        checks.no_atomics_check(spec)


def test_the_atomic_check_sees_the_atomics_of_the_non_deterministic_variant():
    """The control: the same regex finds the atomic dQ accumulation where it belongs."""
    assert ATOMIC_CALL.search(render(Spec(64, mask="causal")).code)
    atomic = render(Spec(64))
    with pytest.raises(AssertionError, match="calls"):
        checks.no_atomics_check(Spec(64, deterministic=True), Source(spec=Spec(64, deterministic=True),
                                                                      code=atomic.code, kernels=atomic.kernels))


needs_cuobjdump = pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")


@needs_cuobjdump
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", [Spec(64, mask="causal", dropout=True, deterministic=True),
                                  Spec(128, version=1, key_padding=True, deterministic=True)], ids=lambda s: s.name)
def test_deterministic_machine_code_has_no_atomic_instruction(spec, arch):
    checks.no_atomics_check(spec, sass_arch=arch)


@needs_cuobjdump
def test_the_machine_code_check_sees_the_non_deterministic_atomics():
    sass = disassemble(*compile_source(render(Spec(64, mask="causal")), "sm_90").cubins)
    assert checks.ATOMIC_SASS.search(sass), "the non-deterministic backward's RED/ATOM should show in its SASS"


@pytest.mark.parametrize("version", [1, 2])
def test_deterministic_repeats_are_bit_identical_in_any_block_order(version):
    checks.repeat_check(Spec(64, version=version, mask="causal", dropout=True, deterministic=True))


@pytest.mark.parametrize("version", [1, 2])
def test_the_repeat_check_fails_on_the_atomic_variant(version):
    """The positive control: with the blocks reversed, the atomic dq sums in another order and
    its bits differ, so the repeat check above can fail."""
    with pytest.raises(AssertionError, match="dq differs between block orders"):
        checks.repeat_check(Spec(64, version=version, mask="causal", dropout=True))


def test_block_order_reverses_only_the_atomic_sums(monkeypatch):
    """dk and dv have one writer per element: they are the same bits in either order; dq
    (atomics) is not."""
    spec = Spec(64, mask="causal")
    source = render(spec)
    q, k, v, dout, _ = make_inputs(spec, checks.REPEAT_SHAPE)
    out, stats = attention_kernels.forward(source, q, k, v)
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "1")
    grads = {}
    for order in ("forward", "reverse"):
        monkeypatch.setenv("FAGEN_EMULATE_BLOCK_ORDER", order)
        grads[order] = attention_kernels.backward(source, q, k, v, out, stats, dout)
    (dq, dk, dv), (dq_r, dk_r, dv_r) = grads["forward"], grads["reverse"]
    assert torch.equal(dk, dk_r) and torch.equal(dv, dv_r)
    assert not torch.equal(dq, dq_r)
    assert (dq.double() - dq_r.double()).abs().max().item() < 1e-2   # a reordered sum, not a wrong one


def test_a_bad_block_order_is_named(monkeypatch):
    from fagen.emulate import EmulationError

    monkeypatch.setenv("FAGEN_EMULATE_BLOCK_ORDER", "sideways")
    spec = Spec(64)
    q, k, v, _, _ = make_inputs(spec, Shape(1, 16, 16))
    with pytest.raises(EmulationError, match="FAGEN_EMULATE_BLOCK_ORDER='sideways'"):
        attention_kernels.forward(render(spec), q, k, v)
