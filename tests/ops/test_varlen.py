"""Packed sequences (`flash_attn_varlen_func`, Spec.varlen) on the emulator: each sequence's
output, L and gradients against the float64 oracle run on that sequence alone (FlashAttention-2's
rule, yardstick the same-dtype implementation on the same sequence), with zero-length query and
key sequences, causal bottom-right per sequence, GQA, dropout keyed on each sequence's own
coordinates, variants, and every bad input."""

import sys

import pytest
import torch

import fagen
from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.reference import attention_gradients, attention_same_dtype, dropout_keep_mask
from fagen.spec import Spec
from kernel_cases import ABS_FLOOR, DROPOUT_P, GRAD_FACTOR, OFFSET, OUTPUT_FACTOR, SEED, max_error

LENGTHS_Q, LENGTHS_K = [70, 0, 130, 5, 33], [90, 40, 0, 77, 33]   # empty queries, empty keys, Nq > Nk, ...


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed(dtype, heads=4, kv_heads=2, d=64, seed=0, d_v=None):
    gen = torch.Generator().manual_seed(seed)
    d_v = d_v or d
    q = torch.randn(sum(LENGTHS_Q), heads, d, generator=gen).to(dtype)
    k = torch.randn(sum(LENGTHS_K), kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(sum(LENGTHS_K), kv_heads, d_v, generator=gen).to(dtype)
    dout = torch.randn(sum(LENGTHS_Q), heads, d_v, generator=gen).to(dtype)
    return q, k, v, dout


def check_sequences(got: dict, q, k, v, dout, dlse, causal, keep=None, **variant):
    """Each non-empty sequence against the oracle on it alone; the worst error of each output
    against the worst yardstick error."""
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    worst: dict = {}
    for b, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq == 0:
            continue
        if lk == 0:   # no key at all: O = 0, L = +inf (or the sink), no gradient to Q
            assert torch.equal(got["out"][rows], torch.zeros_like(got["out"][rows]))
            assert torch.equal(got["dq"][rows], torch.zeros_like(got["dq"][rows]))
            continue
        one = [t[None] for t in (q[rows], k[keys], v[keys], dout[rows])]
        drop = {} if keep is None else {"dropout_p": DROPOUT_P, "keep_mask": keep[b:b + 1, :, :lq, :lk]}
        ref = attention_gradients(*one, dlse=dlse[b:b + 1, :, :lq], causal=causal, **drop, **variant)
        same = attention_same_dtype(*one, dlse=dlse[b:b + 1, :, :lq], causal=causal, **drop, **variant)
        pairs = {"out": (got["out"][rows], same[0][0], ref["out"][0]),
                 "dq": (got["dq"][rows], same[1][0], ref["dq"][0]),
                 "dk": (got["dk"][keys], same[2][0], ref["dk"][0]), "dv": (got["dv"][keys], same[3][0], ref["dv"][0])}
        lse_error = max_error(got["lse"][b, :, :lq], ref["lse"][0])
        assert lse_error < 1e-3, f"sequence {b}: L error {lse_error:.3g}"
        for name, (mine, yard, exact) in pairs.items():
            e, y = worst.get(name, (0.0, 0.0))
            worst[name] = (max(e, max_error(mine, exact)), max(y, max_error(yard, exact)))
    for name, (kernel_err, torch_err) in worst.items():
        factor = OUTPUT_FACTOR if name == "out" else GRAD_FACTOR
        assert kernel_err <= factor * torch_err + ABS_FLOOR, f"{name}: {kernel_err:.3g} vs PyTorch's {torch_err:.3g}"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", [1, 2])
def test_kernels_per_sequence(version, causal, deterministic):
    dtype = torch.bfloat16 if causal else torch.float16
    q, k, v, dout = packed(dtype)
    spec = Spec(64, version=version, varlen=True, mask="causal" if causal else "none", deterministic=deterministic,
                dtype="bf16" if causal else "fp16")
    source = render(spec)
    varlen = (cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    out, stats = attention_kernels.forward(source, q, k, v, varlen=varlen)
    dlse = torch.randn(len(LENGTHS_Q), 4, max(LENGTHS_Q))
    dq, dk, dv = attention_kernels.backward(source, q, k, v, out, stats, dout, varlen=varlen, dlse=dlse)
    lse = stats[0] if version == 2 else stats[0] + torch.log(stats[1])
    check_sequences({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, q, k, v, dout, dlse, causal)
    assert torch.equal(dk[cu(LENGTHS_K)[1]:cu(LENGTHS_K)[2]], torch.zeros_like(dk[:40]))  # keys nobody queries


# The sm90 family on packed sequences: its TMA maps see (1, total, H, d) and each block's sequence
# starts at its cu_seqlens row (a tile past the sequence's end reads the next one's rows, masked as
# keys and unstored as queries; in the backward, P = 0 on them by L's +inf padding); its own
# backward at d 64 and 128, and its paired form at 256 and 192/128. Every output buffer poisoned.
SM90 = [Spec(64, varlen=True, mask="causal", dtype="bf16", arch_family="sm90"),
        Spec(128, varlen=True, dtype="fp16", arch_family="sm90"),
        Spec(256, varlen=True, mask="causal", dtype="bf16", arch_family="sm90"),
        Spec(192, head_dim_v=128, varlen=True, dtype="bf16", arch_family="sm90")]


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("spec", SM90, ids=lambda s: s.name)
def test_the_sm90_family_per_sequence(spec):
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q, k, v, dout = packed(dtype, d=spec.head_dim, d_v=spec.head_dim_v or spec.head_dim)
    source = render(spec)
    varlen = (cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    out, stats = attention_kernels.forward(source, q, k, v, varlen=varlen)
    dlse = torch.randn(len(LENGTHS_Q), 4, max(LENGTHS_Q))
    dq, dk, dv = attention_kernels.backward(source, q, k, v, out, stats, dout, varlen=varlen, dlse=dlse)
    check_sequences({"out": out, "lse": stats[0], "dq": dq, "dk": dk, "dv": dv}, q, k, v, dout, dlse, spec.causal)


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("spec", [Spec(64, varlen=True, arch_family="sm90"),
                                  Spec(192, varlen=True, mask="causal", dtype="bf16", arch_family="sm90")],
                         ids=lambda s: s.name)
def test_the_sm90_backward_loads_no_keys_past_the_last_sequence(spec, monkeypatch):
    """The last sequence is shorter than a key block: the grid's later key blocks start past the
    packed rows. They walk nothing, so their K_j and V_j are not loaded (a TMA box wholly outside
    its tensor, which the emulator refuses; the hardware's behaviour there is not documented)."""
    monkeypatch.setattr(sys.modules[__name__], "LENGTHS_Q", [140, 20])
    monkeypatch.setattr(sys.modules[__name__], "LENGTHS_K", [150, 20])
    test_the_sm90_family_per_sequence(spec)


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_dropout_is_keyed_on_each_sequences_own_coordinates(family):
    """The keep mask of sequence b is the padded batch's entry b: packing never changes it."""
    q, k, v, dout = packed(torch.float16, seed=1)
    spec = Spec(64, varlen=True, mask="causal", dropout=True, arch_family=family)
    source = render(spec)
    varlen = (cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    out, stats = attention_kernels.forward(source, q, k, v, varlen=varlen, dropout_p=DROPOUT_P, seed=SEED,
                                           philox_offset=OFFSET)
    dlse = torch.zeros(len(LENGTHS_Q), 4, max(LENGTHS_Q))
    grads = attention_kernels.backward(source, q, k, v, out, stats, dout, varlen=varlen, dlse=dlse,
                                       dropout_args=attention_kernels.dropout_args(DROPOUT_P, SEED, OFFSET))
    keep = dropout_keep_mask(SEED, OFFSET, len(LENGTHS_Q), 4, max(LENGTHS_Q), max(LENGTHS_K), DROPOUT_P)
    check_sequences({"out": out, "lse": stats[0], "dq": grads[0], "dk": grads[1], "dv": grads[2]}, q, k, v, dout,
                    dlse, True, keep=keep)


@pytest.mark.parametrize("family", ["", "sm90"])
def test_the_op_with_variants_sinks_and_a_differentiable_lse(family, monkeypatch):
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
    q, k, v, dout = (t.requires_grad_() for t in packed(torch.bfloat16, seed=2))
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], requires_grad=True)
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                            0.0, None, True, (30, 0), 5.0, return_lse=True, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    dlse_packed = torch.randn_like(lse)
    dq, dk, dv, dsinks = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse_packed).sum(),
                                             (q, k, v, sinks))
    cu_q = cu(LENGTHS_Q)
    dlse = torch.zeros(len(LENGTHS_Q), 4, max(LENGTHS_Q))
    slots = torch.zeros(len(LENGTHS_Q), 4, max(LENGTHS_Q))
    for b, n in enumerate(LENGTHS_Q):
        dlse[b, :, :n] = dlse_packed[:, cu_q[b]:cu_q[b + 1]]
        slots[b, :, :n] = lse.detach()[:, cu_q[b]:cu_q[b + 1]]
    check_sequences({"out": out.detach(), "lse": slots, "dq": dq, "dk": dk, "dv": dv}, q.detach(), k.detach(),
                    v.detach(), dout, dlse, True, window_size=(30, 0), softcap=5.0, sinks=sinks.detach())
    # the sinks' gradient, summed over the sequences (a sequence with no key: P_sink = 1, D = 0)
    expected = torch.zeros(4, dtype=torch.float64)
    for b, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu(LENGTHS_K)[b], cu(LENGTHS_K)[b + 1])
        if lq and lk:
            expected += attention_gradients(q.detach()[rows][None], k.detach()[keys][None], v.detach()[keys][None],
                                            dout[rows][None], dlse=dlse[b:b + 1, :, :lq], causal=True,
                                            window_size=(30, 0), softcap=5.0, sinks=sinks.detach())["dsinks"]
        elif lq:
            expected += dlse[b, :, :lq].double().sum(1)
    assert max_error(dsinks, expected) < 2e-2 * expected.abs().max().item()


def test_the_op_equals_attention_on_each_sequence():
    q, k, v, _ = packed(torch.float16, seed=3)
    out = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                       causal=True)
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    for b, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        if lq and lk:
            alone = fagen.flash_attn_func(q[cu_q[b]:cu_q[b + 1]][None], k[cu_k[b]:cu_k[b + 1]][None],
                                          v[cu_k[b]:cu_k[b + 1]][None], causal=True)[0]
            torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], alone, atol=2e-3, rtol=0)


def test_packings_that_differ_only_in_their_count_of_sequences_get_their_own_launches():
    """Two packings with the same totals and maxima but a different number of sequences: the
    second call must not reuse the first's launch plan (its grid and statistics size the batch;
    once, it did, and sequences 3 and 4 were never computed)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(256, 2, 64, generator=gen).to(torch.float16) for _ in range(4))
    for lengths in ([128, 128], [128, 64, 32, 32]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fagen.flash_attn_varlen_func(*leaves, cu(lengths), cu(lengths), 128, 128, causal=True)
        grads = torch.autograd.grad(out, leaves, dout)
        offsets = cu(lengths)
        for b in range(len(lengths)):
            rows = slice(offsets[b], offsets[b + 1])
            one = [t[rows][None] for t in (q, k, v, dout)]
            ref = attention_gradients(*one, causal=True)
            same = attention_same_dtype(*one, causal=True)
            for got, yard, exact in zip((out, *grads), same, (ref["out"], ref["dq"], ref["dk"], ref["dv"])):
                bound = GRAD_FACTOR * max_error(yard[0], exact[0]) + ABS_FLOOR
                assert max_error(got.detach()[rows], exact[0]) <= bound, (lengths, b)


def _args():
    q, k, v, _ = packed(torch.float16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(LENGTHS_Q), cu_seqlens_k=cu(LENGTHS_K),
                max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K))


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"cu_seqlens_q": cu(LENGTHS_Q).long()}, TypeError, "cu_seqlens_q must be an int32 tensor"),
    ({"cu_seqlens_q": cu(LENGTHS_Q)[None]}, ValueError, "cu_seqlens_q must be 1-D"),
    ({"cu_seqlens_k": cu(LENGTHS_K) + 1}, ValueError, "cu_seqlens_k must start at 0"),
    ({"cu_seqlens_q": torch.tensor([0, 70, 60, 200, 205, 238], dtype=torch.int32)}, ValueError, "non-decreasing"),
    ({"cu_seqlens_q": torch.tensor([0, 70, 70, 200, 205, 237], dtype=torch.int32)}, ValueError,
     r"cu_seqlens_q\[-1\] must equal the 238 tokens"),
    ({"max_seqlen_q": 100}, ValueError, "max_seqlen_q = 100 is smaller than a sequence of 130 tokens"),
    ({"max_seqlen_k": -1}, ValueError, "max_seqlen_k must be an int >= 0"),
    ({"cu_seqlens_k": cu(LENGTHS_K[:-1] + [0, 33])}, ValueError, "describe as many sequences"),
    ({"block_table": torch.zeros(5, 2, dtype=torch.int32)}, ValueError, "block_table"),
    ({"q": torch.zeros(1, 238, 4, 64, dtype=torch.float16)}, ValueError, "q must have 3 dims"),
    ({"k": torch.zeros(240, 3, 64, dtype=torch.float16), "v": torch.zeros(240, 3, 64, dtype=torch.float16)},
     ValueError, "multiple of k's"),
])
def test_bad_packed_inputs(change, error, message, monkeypatch):
    """With the values read on the host (FAGEN_CHECK_VALUES=1) every message names the entry;
    without, the checks of shapes and types are the same (test_bad_values_are_refused_by_the_guards)."""
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    args = {**_args(), **change}
    with pytest.raises(error, match=message):
        fagen.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("change", [
    {"cu_seqlens_k": cu(LENGTHS_K) + 1},                                               # past the packed keys
    {"cu_seqlens_q": torch.tensor([0, 70, 60, 200, 205, 238], dtype=torch.int32)},     # a negative length
    {"max_seqlen_q": 100},                                                             # a sequence past the grid
], ids=["past the rows", "decreasing", "max_seqlen too small"])
@pytest.mark.parametrize("family", ["", "sm90"])
def test_bad_values_are_refused_by_the_guards(change, family, monkeypatch):
    """By default the values are not read on the host (a sync): the kernels refuse a sequence
    outside the packed rows or longer than max_seqlen, and the call raises from their flag."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
    args = {**_args(), **change}
    with pytest.raises(ValueError, match="out of range in cu_seqlens_q or cu_seqlens_k.*FAGEN_CHECK_VALUES=1"):
        fagen.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("spec", [Spec(64, varlen=True, mask="causal", dropout=True, block_m=64, block_n=32),
                                  Spec(64, version=1, varlen=True, block_m=64, block_n=32),
                                  Spec(64, varlen=True, mask="causal", deterministic=True),
                                  Spec(64, varlen=True, mask="causal", dropout=True, arch_family="sm90"),
                                  Spec(64, varlen=True, mask="causal", arch_family="sm90")],   # its own backward
                         ids=lambda s: s.name)
def test_packed_kernels_are_race_free(spec, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    # The sm90 family's producer and consumers in a random order (warp-serial would run the
    # consumers' waits before the producer's loads forever).
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "random" if spec.arch_family == "sm90" else "warp-serial")
    q, k, v, dout = packed(torch.float16, seed=4)
    source = render(spec)
    varlen = (cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    drop = dict(dropout_p=DROPOUT_P, seed=SEED, philox_offset=OFFSET) if spec.dropout else {}
    out, stats = attention_kernels.forward(source, q, k, v, varlen=varlen, **drop)
    attention_kernels.backward(source, q, k, v, out, stats, dout, varlen=varlen,
                 dropout_args=attention_kernels.dropout_args(DROPOUT_P, SEED, OFFSET) if spec.dropout else None)


def test_packed_names_round_trip():
    spec = Spec(128, mask="causal", varlen=True, window=True)
    assert spec.name == "fa2_d128_causal_window_fp16_varlen" and Spec.from_name(spec.name) == spec
    with pytest.raises(ValueError, match="no key_padding"):
        Spec(64, varlen=True, key_padding=True)
