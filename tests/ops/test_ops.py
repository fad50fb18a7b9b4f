"""The user op on CPU tensors (the emulated backend): API, autograd, torch.compile,
opcheck, generated modules and clear errors for bad input."""

import importlib
import inspect
import logging
import math
import sys
import types
import warnings

import pytest
import torch

import fagen
from fagen.kernels import attention_kernels
from fagen.ops import autograd, call, common, dense
from fagen.reference import attention_backward, attention_forward, attention_gradients, attention_same_dtype

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def qkv(batch=2, seqlen_q=40, seqlen_k=56, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16,
        requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return (make(batch, seqlen_q, heads, head_dim), make(batch, seqlen_k, kv_heads, head_dim),
            make(batch, seqlen_k, kv_heads, head_dim))


def within_rule(got, ref, yardstick, factor):
    err = (got.double() - ref).abs().max().item()
    assert err <= factor * (yardstick.double() - ref).abs().max().item() + 1e-5, err


# -- results -----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_forward_backward_and_lse(version):
    q, k, v = qkv(requires_grad=True)
    out, lse = fagen.flash_attn_func(q, k, v, causal=True, return_lse=True, version=version)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, ref_lse = attention_forward(q, k, v, causal=True)
    grads = attention_backward(q, k, v, ref, dout, causal=True)
    pt = attention_same_dtype(q, k, v, dout, causal=True)
    within_rule(out, ref, pt[0], 2)
    for got, r, y in zip((q.grad, k.grad, v.grad), grads, pt[1:]):
        within_rule(got, r, y, 3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3


def test_attention_takes_pytorch_layout():
    q, k, v = qkv()
    out = fagen.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert out.shape == (2, 4, 40, 64)
    torch.testing.assert_close(out.transpose(1, 2), fagen.flash_attn_func(q, k, v, causal=True))


def test_key_padding_and_non_contiguous_inputs():
    q, k, v = qkv(head_dim=32)
    seqlens = torch.tensor([56, 20], dtype=torch.int32)
    wide = torch.randn(2, 56, 2, 40).to(torch.float16)[..., 3:35]  # misaligned rows: copied, not refused
    out = fagen.flash_attn_func(q, wide, v, seqlens_k=seqlens)
    ref, _ = attention_forward(q, wide, v, seqlens_k=seqlens)
    pt = attention_same_dtype(q, wide, v, torch.ones_like(q), seqlens_k=seqlens)[0]
    within_rule(out, ref, pt, 2)


def test_dropout_follows_torch_manual_seed():
    q, k, v = qkv()
    torch.manual_seed(7)
    a = fagen.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    b = fagen.flash_attn_func(q, k, v, dropout_p=0.3)
    c = fagen.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_under_cuda_graph_capture_is_refused(monkeypatch):
    """The Philox pair is a launch argument: a captured graph would replay one mask forever."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        common.philox_state(0.1, torch.device("cuda", 0))
    assert common.philox_state(0.0, torch.device("cuda", 0)) is None   # no dropout: nothing to replay
    assert common.philox_state(0.1, torch.device("cpu")).shape == (2,)  # CPU tensors are never captured


def test_dropout_compiles_fullgraph_for_cuda_tensors(monkeypatch):
    """Dynamo refuses torch.cuda.is_current_stream_capturing() ("torch.* op returned non-Tensor"):
    the traced draw of the Philox pair for CUDA tensors must not ask it. The binding under it is
    stubbed as on a CUDA build, so dynamo meets the real torch function."""
    import torch.cuda.graphs

    monkeypatch.setattr(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", lambda: False)
    torch._dynamo.reset()
    draw = torch.compile(lambda p: common.philox_state(p, torch.device("cuda", 0)), fullgraph=True, backend="eager")
    assert draw(0.25).shape == (2,)


def test_a_compiled_call_with_dropout_checks_for_capture_each_time_it_runs(monkeypatch):
    """Traced, the check moves into the custom op's implementation: it runs on every call of the
    compiled graph (so capturing one with dropout is still refused), never at trace time."""
    seen = []
    monkeypatch.setattr(autograd, "refuse_graph_capture", seen.append)
    torch._dynamo.reset()
    q, k, v = qkv(batch=1, seqlen_q=16, seqlen_k=16, heads=2, kv_heads=2, head_dim=32)
    compiled = torch.compile(lambda q, k, v, p: fagen.flash_attn_func(q, k, v, dropout_p=p), fullgraph=True,
                             backend="aot_eager")
    compiled(q, k, v, 0.2)
    compiled(q, k, v, 0.2)
    compiled(q, k, v, 0.0)   # no dropout: nothing to refuse
    assert seen == [q.device, q.device]


def test_numpy_bools_are_flags():
    """np.True_ (what `arr.any()` gives) is a flag; the custom op is handed a Python bool."""
    np = pytest.importorskip("numpy")
    q, k, v = qkv(batch=1, seqlen_q=16, seqlen_k=24, heads=2, kv_heads=2, head_dim=32)
    want = fagen.flash_attn_func(q, k, v, causal=True, return_lse=True)
    got = fagen.flash_attn_func(q, k, v, causal=np.bool_(True), return_lse=np.True_, deterministic=np.False_)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert common.check_flag("causal", np.True_) is True and common.check_flag("causal", np.False_) is False
    for wrong in (np.array([True]), np.int64(1)):
        with pytest.raises(TypeError, match="causal must be True or False"):
            common.check_flag("causal", wrong)


def test_a_numpy_bool_under_torch_compile_falls_back_to_eager(monkeypatch):
    """dynamo traces np.True_ as data (a 0-d array), so a compiled call cannot read it: the check
    says so, dynamo breaks the graph there and the call runs eagerly, where it is accepted."""
    np = pytest.importorskip("numpy")
    q, k, v = qkv(batch=1, seqlen_q=16, seqlen_k=24, heads=2, kv_heads=2, head_dim=32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, c: fagen.flash_attn_func(q, k, v, causal=c), backend="eager")
    assert torch.equal(compiled(q, k, v, np.True_), fagen.flash_attn_func(q, k, v, causal=True))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(TypeError, match="causal: under torch.compile pass a Python bool"):
        common.check_flag("causal", np.True_)


def test_deterministic_backward_repeats_bit_for_bit():
    q, k, v = qkv(requires_grad=True)
    grads = []
    for _ in range(3):
        torch.manual_seed(3)
        out = fagen.flash_attn_func(q, k, v, dropout_p=0.2, deterministic=True)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for again in grads[1:]:
        for a, b in zip(grads[0], again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("version", [1, 2])
def test_lse_is_differentiable(version):
    """dS = P (dP - (D - dL)): the gradient of the returned L alone, and with O's."""
    q, k, v = qkv(requires_grad=True)
    out, lse = fagen.flash_attn_func(q, k, v, causal=True, return_lse=True, version=version)
    assert out.requires_grad and lse.requires_grad
    dlse = torch.randn_like(lse)
    for dout in (torch.zeros_like(out), torch.randn_like(out)):
        loss = (lse * dlse).sum() + (out.float() * dout.float()).sum()
        got = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
        ref = attention_gradients(q, k, v, dout, dlse=dlse, causal=True)
        yardstick = attention_same_dtype(q, k, v, dout, dlse=dlse, causal=True)[1:]
        for name, g, y in zip(("dq", "dk", "dv"), got, yardstick):
            within_rule(g, ref[name], y, 3)


def test_seqlens_k_may_be_a_view():
    q, k, v = qkv(requires_grad=True)
    strided = torch.tensor([56, 0, 20, 0], dtype=torch.int32)[::2]  # not contiguous
    out = fagen.flash_attn_func(q, k, v, seqlens_k=strided)
    ref, _ = attention_forward(q, k, v, seqlens_k=strided.contiguous())
    pt = attention_same_dtype(q, k, v, torch.ones_like(q), seqlens_k=strided.contiguous())[0]
    within_rule(out, ref, pt, 2)


def test_heads_and_a_batch_past_the_grid_limit_launch_in_chunks(monkeypatch):
    """With the grid's y/z limit lowered to 5, 7 heads and a batch of 12 go out in 2 x 3
    launches, each at its heads' and entries' offsets: forward and backward as one launch."""
    from fagen.kernels import launch

    q, k, v = qkv(batch=12, seqlen_q=16, seqlen_k=24, heads=7, kv_heads=7, head_dim=16, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).half()
    whole = fagen.flash_attn_func(q, k, v, causal=True)
    expected = (whole, *torch.autograd.grad(whole, (q, k, v), dout))
    monkeypatch.setattr(launch, "GRID_YZ_LIMIT", 5)
    monkeypatch.setattr(attention_kernels, "_plans", {})
    monkeypatch.setattr(dense, "_calls", {})   # and the plans a warm call keeps (attention_kernels.Memo)
    real_chunks, counts = launch.grid_chunks, []

    def counted(grid, limit=None):
        chunks = list(real_chunks(grid, limit))
        counts.append(len(chunks))
        return iter(chunks)

    monkeypatch.setattr(launch, "grid_chunks", counted)
    chunked = fagen.flash_attn_func(q, k, v, causal=True)
    for a, b in zip(expected, (chunked, *torch.autograd.grad(chunked, (q, k, v), dout))):
        assert torch.equal(a, b)
    assert 6 in counts   # the main kernels' (x, 7, 12) grids: 2 x 3 launches


@pytest.mark.slow
def test_a_batch_past_the_grid_limit_launches_in_chunks():
    # 65537 sequences of one query: more than gridDim.z's 65535 (the emulator, like the
    # GPU, refuses such a launch), so the batch goes out in two launches.
    q = torch.randn(65537, 1, 1, 16).half()
    k = torch.randn(65537, 3, 1, 16).half()
    v = torch.randn(65537, 3, 1, 16).half()
    out = fagen.flash_attn_func(q, k, v)
    ref, _ = attention_forward(q, k, v)
    assert (out.double() - ref).abs().max() < 1e-2


def test_empty_problems_look_up_tiles_with_positive_sizes(monkeypatch):
    from fagen import tuning
    from fagen.tuning.cache import ShapeBucket

    seen = []

    def strict_lookup(spec, **sizes):  # what a GPU lookup does with the sizes
        ShapeBucket.of(seqlen_q=sizes["seqlen_q"], seqlen_k=sizes["seqlen_k"], batch=sizes["batch"],
                       heads=sizes["heads"])
        seen.append(sizes)
        return spec

    monkeypatch.setattr(tuning, "lookup", strict_lookup)
    monkeypatch.setattr(call, "_call_sources", {})
    for shape in [dict(batch=0), dict(seqlen_q=0), dict(seqlen_k=0)]:
        q, k, v = qkv(**shape)
        fagen.flash_attn_func(q, k, v)
    assert len(seen) == 3


def test_empty_problems_are_defined():
    q, k, v = qkv(batch=0)
    assert fagen.flash_attn_func(q, k, v).shape == (0, 40, 4, 64)
    q, k, v = qkv(seqlen_k=0, requires_grad=True)
    out, lse = fagen.flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_nan_and_inf_propagate_like_pytorch():
    q, k, v = qkv(batch=1, heads=2, kv_heads=2)
    q[0, 3, 1, 5] = float("nan")
    v[0, 10, 0, 2] = float("inf")
    out = fagen.flash_attn_func(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)).transpose(1, 2)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.isinf(out), torch.isinf(expected))


# -- bad input ----------------------------------------------------------------------------------

def bad(**changes):
    q, k, v = qkv(batch=2, seqlen_q=8, seqlen_k=8, heads=2, kv_heads=2, head_dim=32)
    args = {"q": q, "k": k, "v": v, **changes}
    return args.pop("q"), args.pop("k"), args.pop("v"), args


Q, K, V = qkv(batch=2, seqlen_q=8, seqlen_k=8, heads=2, kv_heads=2, head_dim=32)


@pytest.mark.parametrize("q, k, v, kwargs, error, message", [
    (Q, K.to(torch.bfloat16), V, {}, TypeError, "q, k and v must share a dtype"),
    (Q.float(), K.float(), V.float(), {}, TypeError, "q must be float16 or bfloat16, got torch.float32"),
    (Q, K.to(torch.int32), V, {}, TypeError, "k must be float16 or bfloat16, got torch.int32"),
    (Q, K.to("meta"), V, {}, ValueError, "must be on one device"),
    (Q[0], K, V, {}, ValueError, r"q must have 4 dims"),
    (Q, K[..., :16], V[..., :16], {}, ValueError, "q and k must have the same head_dim, got 32 and 16"),
    (Q, K[:, :, :1].expand(2, 8, 1, 32), V, {}, ValueError, "k and v must have the same shape"),
    (torch.randn(2, 8, 3, 32).half(), K, V, {}, ValueError, r"q's number of heads \(3\) must be a multiple of k's \(2\)"),
    (torch.randn(1, 4, 1, 520).half(), torch.randn(1, 4, 1, 520).half(), torch.randn(1, 4, 1, 520).half(), {},
     ValueError, r"head_dim \(q.shape\[-1\]\) must be from 1 to 512, got 520"),
    (Q[..., :0], K[..., :0], V[..., :0], {}, ValueError, "head_dim .* from 1 to 512, got 0"),
    (Q, K, V, {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    (Q, K, V, {"dropout_p": -0.5}, ValueError, r"dropout_p must be in \[0, 1\)"),
    (Q, K, V, {"seqlens_k": torch.tensor([8, 8])}, TypeError, "seqlens_k must be an int32 tensor"),
    (Q, K, V, {"seqlens_k": [8, 8]}, TypeError, "seqlens_k must be an int32 tensor"),
    (Q, K, V, {"seqlens_k": torch.tensor([8], dtype=torch.int32)}, ValueError, r"seqlens_k must have shape \(2,\)"),
    (Q, K, V, {"seqlens_k": torch.tensor([8, 9], dtype=torch.int32)}, ValueError, r"values must be in \[0, 8\]"),
    (Q, K, V, {"seqlens_k": torch.tensor([-1, 3], dtype=torch.int32)}, ValueError, r"values must be in \[0, 8\]"),
    (Q, K, V, {"version": 3}, ValueError, "version must be 1 or 2"),
    (Q, K, V, {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a float"),
    (Q, K, V, {"softmax_scale": 0.0}, ValueError, "softmax_scale must be a positive finite float, got 0.0"),
    (Q, K, V, {"softmax_scale": -0.125}, ValueError, "softmax_scale must be a positive finite float"),
    (Q, K, V, {"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a positive finite float"),
    (Q, K, V, {"version": True}, ValueError, "version must be 1 or 2"),
    (Q, K, V, {"causal": "no"}, TypeError, r"causal must be True or False, got 'no'"),
    (Q, K, V, {"causal": 1}, TypeError, "causal must be True or False, got 1"),
    (Q, K, V, {"causal": "yes"}, TypeError, "causal must be True or False"),
    (Q, K, V, {"deterministic": 1}, TypeError, "deterministic must be True or False"),
    (Q, K, V, {"return_lse": "yes"}, TypeError, "return_lse must be True or False"),
    (Q, K, V, {"dropout_p": True}, TypeError, "dropout_p must be a float"),
    (Q, K, V, {"causal": torch.tensor(True)}, TypeError,
     r"causal must be True or False, got a tensor .*bool\(causal\)"),
    (Q, K, V, {"return_lse": ""}, TypeError, "return_lse must be True or False"),
    (Q, K.to_sparse(), V, {}, TypeError, r"k must be a dense \(torch.strided\) tensor, got layout torch.sparse_coo"),
    ("q", K, V, {}, TypeError, "q must be a torch.Tensor"),
])
def test_bad_input_is_a_clear_error(q, k, v, kwargs, error, message):
    with pytest.raises(error, match=message):
        fagen.flash_attn_func(q, k, v, **kwargs)


def test_non_contiguous_last_dim_is_refused():
    q = torch.randn(2, 8, 2, 64).half()[..., ::2]
    with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
        fagen.flash_attn_func(q, K, V)


# -- torch.compile and opcheck ------------------------------------------------------------------

def test_torch_compile_fullgraph_without_graph_breaks():
    torch._dynamo.reset()
    q, k, v = qkv(requires_grad=True)

    def step(q, k, v, dropout_p):
        return fagen.flash_attn_func(q, k, v, causal=True, dropout_p=dropout_p).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, 0.0)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager_loss = step(q, k, v, 0.0)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)
    dropped = compiled(q, k, v, 0.25)  # the Philox seed is drawn inside the graph
    torch.autograd.grad(dropped, (q, k, v))
    explanation = torch._dynamo.explain(step)(q, k, v, 0.25)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("version, dropout_p", [(2, 0.0), (1, 0.0), (2, 0.2)])
def test_opcheck(version, dropout_p):
    """The one custom-op pair every call traces to (fagen/ops/autograd.py), held to torch's own
    checks: schema, fake implementations against the real ones, and the registered autograd."""
    from fagen.ops.call import options_for, params_tensor, values_of

    q, k, v = qkv(batch=1, seqlen_q=24, seqlen_k=40, heads=2, kv_heads=1, head_dim=32, requires_grad=True)
    options = options_for(q, version=version, causal=True, key_padding=False, dropout=dropout_p > 0,
                          deterministic=False)
    values = values_of(options, seqlens_k=None, rng=common.philox_state(dropout_p, q.device), varlen=None,
                       softmax_scale=1 / math.sqrt(32), dropout_p=dropout_p, variant_values=None)
    args = (q, k, v, values.tensors, values.floats, values.ints, params_tensor(values.params), options.key())
    torch.library.opcheck(torch.ops.fagen.attention_fwd.default, args)
    out, lse, fa1 = (t.detach() for t in torch.ops.fagen.attention_fwd(*args))
    # The backward op is not itself differentiable (no double backward), as in flash-attn.
    bwd_args = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out, lse, fa1,
                *args[3:])
    torch.library.opcheck(torch.ops.fagen.attention_bwd.default, bwd_args)


# -- generated op modules -----------------------------------------------------------------------

def test_generated_module_runs_with_autograd(tmp_path, monkeypatch):
    from fagen.cli import main

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out_dir = tmp_path / "pkg" / "gen"
    assert main(["build", "--d", "32", "--causal", "--dtype", "bf16", "--arch", "sm_80",
                 "--out", str(out_dir)]) == 0
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    module = importlib.import_module("gen.fa2_d32_causal_bf16")
    assert module.SPEC.name == "fa2_d32_causal_bf16"
    q, k, v = qkv(head_dim=32, dtype=torch.bfloat16, requires_grad=True)
    out = module.flash_attn_func(q, k, v)
    torch.testing.assert_close(out, fagen.flash_attn_func(q, k, v, causal=True))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="takes bf16 inputs with head_dim 32"):
        module.flash_attn_func(q.half(), k.half(), v.half())
    sys.modules.pop("gen.fa2_d32_causal_bf16", None)


def test_generated_module_detects_an_edited_source(tmp_path, monkeypatch):
    from fagen.cli import main

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out_dir = tmp_path / "pkg2" / "gen2"
    main(["build", "--d", "32", "--arch", "sm_80", "--out", str(out_dir)])
    source = out_dir / "fa2_d32_fp16.cu"
    source.write_text(source.read_text() + "\n// edited\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg2"))
    module = importlib.import_module("gen2.fa2_d32_fp16")
    q, k, v = qkv(head_dim=32)
    with pytest.raises(RuntimeError, match="does not match its module"):
        module.flash_attn_func(q, k, v)


def test_generated_module_names_its_layout_and_runs_an_edited_source_on_request(tmp_path, monkeypatch):
    from fagen.cli import main

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out_dir = tmp_path / "pkg3" / "gen3"
    main(["build", "--d", "32", "--causal", "--arch", "sm_80", "--out", str(out_dir)])
    source = out_dir / "fa2_d32_causal_fp16.cu"
    source.write_text(source.read_text().replace("// fagen generated kernel source",
                                                 "// (a printf would go here) fagen generated kernel source"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg3"))
    module = importlib.import_module("gen3.fa2_d32_causal_fp16")
    assert not hasattr(module, "attention")   # `attention` is PyTorch's layout; the module takes flash-attn's
    q, k, v = qkv(head_dim=32)
    with pytest.raises(RuntimeError, match=rf"fagen build --d 32 --causal --out {out_dir}"):
        module.flash_attn_func(q, k, v)
    monkeypatch.setenv("FAGEN_ALLOW_EDITED_SOURCE", "1")
    with pytest.warns(UserWarning, match="edited after its build"):
        out = module.flash_attn_func(q, k, v)
    torch.testing.assert_close(out, fagen.flash_attn_func(q, k, v, causal=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # the warning is given once per file
        module.flash_attn_func(q, k, v)
    sys.modules.pop("gen3.fa2_d32_causal_fp16", None)


# -- first contact: signatures, flags, odd head dims, seqlens_k unchecked, logging ----------------

def test_public_signatures_show_no_private_parameter():
    for func in (fagen.flash_attn_func, fagen.attention):
        assert not [p for p in inspect.signature(func).parameters if p.startswith("_")]


def test_attention_checks_its_flags_too():
    q, k, v = (t.transpose(1, 2) for t in qkv())
    with pytest.raises(TypeError, match="causal must be True or False"):
        fagen.attention(q, k, v, causal="no")


@pytest.mark.parametrize("head_dim, heads, kv_heads", [(12, 4, 2), (1, 2, 2), (100, 2, 1)])
def test_head_dims_off_the_multiple_of_8_are_padded(head_dim, heads, kv_heads):
    q, k, v = qkv(seqlen_q=33, seqlen_k=47, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  requires_grad=True)
    out, lse = fagen.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, heads, 33)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    ref, ref_lse = attention_forward(q, k, v, causal=True)   # scale 1/sqrt(true d)
    grads = attention_backward(q, k, v, ref, dout, causal=True)
    pt = attention_same_dtype(q, k, v, dout, causal=True)
    within_rule(out, ref, pt[0], 2)
    for got, r, y in zip((q.grad, k.grad, v.grad), grads, pt[1:]):
        within_rule(got, r, y, 3)
    explicit = fagen.flash_attn_func(q, k, v, causal=True, softmax_scale=1 / math.sqrt(head_dim))
    assert torch.equal(out, explicit)


def test_unchecked_seqlens_k_values_are_clamped_by_the_kernels(monkeypatch):
    """Under CUDA graph capture or torch.compile the values are not read: a length above Nk
    then counts as Nk and one below 0 as 0, as documented."""
    q, k, v = qkv()
    monkeypatch.setattr(common, "values_checkable", lambda t: False)
    wild = fagen.flash_attn_func(q, k, v, causal=True, seqlens_k=torch.tensor([-3, 999], dtype=torch.int32))
    clamped = fagen.flash_attn_func(q, k, v, causal=True, seqlens_k=torch.tensor([0, 56], dtype=torch.int32))
    assert torch.equal(wild, clamped)
    assert torch.equal(wild[0], torch.zeros_like(wild[0]))   # no key: output 0


def test_seqlens_k_values_are_not_read_while_capturing(monkeypatch):
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not common.values_checkable(on_gpu)
    assert common.values_checkable(torch.zeros(2))   # CPU tensors are never captured
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert common.values_checkable(on_gpu)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not common.values_checkable(torch.zeros(2))


def test_first_load_of_a_variant_is_logged(monkeypatch, caplog):
    from fagen.kernels import launch

    monkeypatch.setattr(launch, "_loaded", {})
    monkeypatch.setattr(attention_kernels, "_plans", {})
    monkeypatch.setattr(dense, "_calls", {})
    q, k, v = qkv(head_dim=32)
    with caplog.at_level(logging.INFO, logger="fagen"):
        fagen.flash_attn_func(q, k, v)
        fagen.flash_attn_func(q, k, v)
    loads = [r.getMessage() for r in caplog.records if "loading" in r.getMessage()]
    assert len(loads) == 1 and "fa2_d32_fp16" in loads[0] and "CPU emulator" in loads[0]


def test_seqlens_k_out_of_range_raises_without_reading_it_and_names_it_when_asked(monkeypatch):
    """By default a lazy device-side assert (no host read: tests/ops/test_no_syncs.py); with
    FAGEN_CHECK_VALUES=1 the values are read, and the message gives them."""
    q, k, v = qkv()
    bad = torch.tensor([3, k.shape[1] + 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqlens_k values must be in \[0, 56\].*FAGEN_CHECK_VALUES=1"):
        fagen.flash_attn_func(q, k, v, seqlens_k=bad)
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=r"seqlens_k values must be in \[0, 56\] .*got values from 3 to 61"):
        fagen.flash_attn_func(q, k, v, seqlens_k=bad)
