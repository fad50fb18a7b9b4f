"""The fagen calls of the GPU check, made small: what kernel_record runs to learn which kernels
the precompile section must build.

Each entry is (label, call): a function of no arguments that makes one of the check's calls on
small CPU tensors, through the object the section itself uses (its System, decode step,
Documents, the ring section's own runner) or the op the gpu test calls, with the arguments that
decide a kernel (dtype, head dim, heads and K/V heads, mask, flags, mods, page size) kept and the
sizes shrunk; or a Spec, where a gpu test renders that Spec itself. tests/bench/test_gpu_check_plan.py
checks the gpu tests' part against the kernels a record run of those tests loads.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from ..arch_families import SM90
from . import gpu_cases as cases
from .sizes import random_lengths
from .speed.config import FAGEN_SYSTEMS

SMALL_N = 64   # tokens per small call: sizes pick no kernel (no tuning cache on a fresh machine)


# -- the sections ---------------------------------------------------------------------------

def section_calls(plan) -> list[tuple[str, object]]:
    """Every fagen call of the plan's sections, small."""
    return (_speed_calls(plan) + _variant_calls(plan) + _decode_calls(plan) + _models_calls(plan)
            + _ring_calls(plan) + _memory_calls(plan) + [("sanitizers", functools.partial(sanitizer_workload, "cpu"))])


def _forward(system, dtype: str, head_dim: int, heads: int, causal: bool, batch: int = 1) -> None:
    from .measure import make_inputs

    system.forward(*make_inputs(batch, SMALL_N, heads, head_dim, dtype, "cpu"), causal)


def _speed_calls(plan) -> list:
    from .peers import make_system

    return [(f"speed {name} {c.label}", functools.partial(_forward, make_system(name), c.dtype, c.head_dim,
                                                          plan.heads(c.head_dim), c.causal))
            for name in plan.systems if name in FAGEN_SYSTEMS for c in plan.configs()]


def _memory_calls(plan) -> list:
    from .peers import make_system

    m = plan.memory
    return [(f"memory {name}", functools.partial(_forward, make_system(name), m.dtype, m.head_dim, m.heads, m.causal))
            for name in m.systems if name in FAGEN_SYSTEMS]


def _variant_calls(plan) -> list:
    from .variants.run import default_factories, make_case

    config, factories = plan.variants, default_factories()
    calls = []
    for name in config.fagen_systems():   # the sm90 family's on CPU tensors: the emulator takes either
        for case in config.cases:
            made = make_case(case, config, batch=config.batch, seqlen=SMALL_N, heads=config.heads, device="cpu")
            calls.append((f"variants {name} {case}", functools.partial(
                _forward, factories[name](made), config.dtype, config.head_dim, config.heads, config.causal,
                config.batch)))
    if config.cases and "fagen_v2_nomod" in config.systems:
        calls.append(("variants no mod", functools.partial(
            _forward, factories["fagen_v2_nomod"](None), config.dtype, config.head_dim, config.heads, config.causal)))
    return calls


def _decode_step(config, system) -> None:
    from .decode.step import make_decode_inputs

    step, _ = system.prepare(make_decode_inputs(config, 1, config.page_size, "cpu"), config)
    step()


def _varlen_forward(config, system) -> None:
    from .decode.varlen import make_documents

    system.docs = make_documents(random_lengths(3 * SMALL_N, 3, config.seed), config.varlen_heads, config.head_dim,
                                 config.dtype, "cpu")
    system.forward(*system.inputs(), True)


def _decode_calls(plan) -> list:
    from .decode.run import default_factories

    config, factories = plan.decode, default_factories()
    calls = [(f"decode {name}", functools.partial(_decode_step, config, factories[name]()))
             for name in config.decode_systems if name.startswith("fagen")]
    calls += [(f"decode {name}", functools.partial(_varlen_forward, config, factories[name]()))
              for name in config.varlen_systems if name in ("fagen_varlen", "fagen_padded")]
    if config.graph_shape:
        calls.append(("decode graph", functools.partial(_graph_step, config)))
    calls += [(f"decode {name}", functools.partial(_mla_step, config, name))
              for name in config.mla_systems if name.startswith("fagen")]
    return calls


def _mla_step(config, name: str) -> None:
    """The absorbed-MLA rows' step (one 576-wide cache, V its first 512 columns) on one page."""
    from .decode.mla import PAGE, make_mla_inputs, mla_step

    mla_step(name, make_mla_inputs(config, 1, PAGE, "cpu"))()


def _graph_step(config) -> None:
    """The CUDA-graph row's step (append with rotary, split-KV, combine) on a one-page cache."""
    from .decode.graph import graph_step, make_graph_inputs

    small = dataclasses.replace(config, graph_shape=(1, config.page_size))
    graph_step(make_graph_inputs(small, "cpu"), small)()


def _models_calls(plan) -> list:
    """The transformers integration's own attention function, as the model's layers call it:
    nothing padded (the training step) and a left-padded (B, N) mask (generate). Without
    transformers the section skips itself and needs no kernel."""
    config = plan.models
    calls = []
    if "fagen" in config.train_systems:
        calls.append(("models train", functools.partial(_integration_call, config, padded=False)))
    if "fagen" in config.decode_systems:
        calls.append(("models generate", functools.partial(_integration_call, config, padded=True)))
    return calls


def _integration_call(config, *, padded: bool) -> None:
    try:
        from fagen.integrations.transformers import attention_forward
    except ImportError:
        return
    import torch

    from .measure import torch_dtype

    dtype, n = torch_dtype(config.dtype), SMALL_N
    query = torch.randn(2, config.heads, n, config.head_dim, dtype=dtype)
    key, value = (torch.randn(2, config.kv_heads, n, config.head_dim, dtype=dtype) for _ in range(2))
    mask = None
    if padded:
        mask = torch.ones(2, n, dtype=torch.int64)
        mask[1, : n // 2] = 0   # left padding, as generate's prompts
    layer = torch.nn.Module()
    layer.is_causal = True   # a decoder layer's attention, as Llama's
    attention_forward(layer, query, key, value, mask, scaling=config.head_dim ** -0.5)


def _ring_calls(plan) -> list:
    if not plan.ring.enabled:
        return []
    return [("ring", functools.partial(_ring_section, plan))]


def _ring_section(plan) -> None:
    """The ring section itself (its world-1 gloo group, its plain, ring and pair calls, its
    model rows) at a short sequence, each measurement one call."""
    from .ring.run import run_ring_section
    from .timing import Deadline

    short = dataclasses.replace(plan.ring, seqlen=4 * SMALL_N)
    run_ring_section(dataclasses.replace(plan, ring=short), Deadline(float("inf"), clock=lambda: 0.0), device="cpu",
                     timer=_one_call, log=lambda line: None)


def _one_call(fn, **kwargs):
    from .timing import Timing

    fn()
    return Timing(median_ms=1.0, min_ms=1.0, max_ms=1.0, repeats=1, host_ms=1.0)


# -- the sanitizers' workload (its script runs this under compute-sanitizer) ---------------------

SANITIZER_SHAPE = (1, 200, 2, 64)   # a ragged length (no tile's multiple): where out-of-bounds bugs live


def sanitizer_workload(device: str) -> list[str]:
    """fagen v2 and v1, causal and not, forward and backward, fp16 d=64, on `device`; one line
    per call that did not run whole."""
    import torch

    from .peers import fagen_attention_func

    attention, notes = fagen_attention_func(), []
    torch.manual_seed(0)
    q, k, v = (torch.randn(SANITIZER_SHAPE, device=device, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    for version in (2, 1):
        for causal in (False, True):
            try:
                out = attention(q, k, v, causal=causal, version=version)
                if out.requires_grad and out.grad_fn is not None:
                    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
                else:
                    notes.append(f"fagen v{version} causal={causal}: forward only (no backward)")
            except Exception as exc:  # noqa: BLE001 - the sanitizer's summary is the result; go on
                notes.append(f"fagen v{version} causal={causal}: {type(exc).__name__}: {exc}")
    return notes


# -- the gpu tests ----------------------------------------------------------------------------

def gpu_test_calls() -> list[tuple[str, object]]:
    """The fagen calls of tests/gpu/test_gpu_kernels.py, test_gpu_decode.py, test_gpu_sm90_features.py,
    test_gpu_sm90_backward_rows.py, test_gpu_fp8_forward.py, test_gpu_fp8_backward.py,
    test_gpu_fp8_decode.py and test_gpu_distributed.py, small (gpu_cases holds their parameters)."""
    return (_kernel_test_calls() + _decode_test_calls() + _sm90_feature_test_calls() + _sm90_backward_row_calls()
            + _fp8_forward_row_calls() + _fp8_backward_row_calls() + _fp8_decode_calls() + _ring_test_calls())


def _dense(dtype: str, head_dim: int, shape=(1, SMALL_N, SMALL_N, 2, 2), seqlens_k: bool = False, **kwargs) -> None:
    """fagen.flash_attn_func on (B, Nq, H, d) / (B, Nk, Hk, d) standard normals."""
    import torch

    import fagen

    from .measure import torch_dtype

    batch, nq, nk, heads, kv_heads = shape
    q = torch.randn(batch, nq, heads, head_dim, dtype=torch_dtype(dtype))
    k, v = (torch.randn(batch, nk, kv_heads, head_dim, dtype=torch_dtype(dtype)) for _ in range(2))
    lengths = torch.full((batch,), nk, dtype=torch.int32) if seqlens_k else None
    fagen.flash_attn_func(q, k, v, seqlens_k=lengths, **kwargs)


def _kernel_test_calls() -> list:
    from fagen.spec import Spec

    calls = [(f"matrix v{v} {dt} causal={c} d{d} {shape}", functools.partial(_dense, dt, d, shape, causal=c, version=v))
             for v, dt, c, d in cases.MATRIX for shape in cases.SHAPES]
    for v, dt, d in cases.DROPOUT_CASES:   # the kernel-level mask test renders its Spec; the others call the op
        calls.append((f"dropout mask v{v} {dt} d{d}", Spec(head_dim=d, dtype=dt, version=v, dropout=True)))
        calls.append((f"dropout v{v} {dt} d{d}", functools.partial(_dense, dt, d, dropout_p=cases.DROPOUT_P,
                                                                   version=v)))
    dt, d = cases.SEEDED_DROPOUT
    calls += [(f"seeded dropout v{v}", functools.partial(_dense, dt, d, dropout_p=cases.DROPOUT_P, version=v))
              for v in (2, 1)]
    calls += [(f"deterministic v{v} causal={c} d{d}", functools.partial(_dense, "bf16", d, causal=c, version=v,
                                                                         deterministic=True))
              for v, c, d in cases.DETERMINISTIC_CASES]
    # The CUDA-graph tests (bf16 d=64 causal; fp16 d=64 causal with seqlens_k) and the batch of
    # 65536 single queries (bf16 d=64).
    calls += [("graph", functools.partial(_dense, "bf16", 64, causal=True)),
              ("graph seqlens_k", functools.partial(_dense, "fp16", 64, seqlens_k=True, causal=True)),
              ("65536 queries", functools.partial(_dense, "bf16", 64, (130, 1, 3, 2, 1)))]
    calls += [(f"kernel case {flags} d{d} v{v}", Spec(d, version=v, dtype="bf16", **flags))
              for flags, _ in cases.KERNEL_CASES for d in cases.KERNEL_CASE_HEAD_DIMS
              for v in cases.KERNEL_CASE_VERSIONS]
    calls += [(f"single stage {flags} v{v}", Spec(128, version=v, dtype="bf16", **flags))
              for flags, _ in cases.SINGLE_STAGE_CASES for v in cases.KERNEL_CASE_VERSIONS]
    return calls


def _decode_case(case: dict, call: dict) -> None:
    """flash_attn_with_kvcache as tests/support/kvcache_cases.check_call makes it (without rotary
    tables: they change no kernel)."""
    import torch

    import fagen

    from .measure import torch_dtype

    s = {**cases.DECODE_SHAPE, **{key: case[key] for key in ("head_dim", "capacity") if key in case}}
    b, h, hk, d, cap = s["batch"], s["heads"], s["kv_heads"], s["head_dim"], s["capacity"]
    dtype, page = torch_dtype(case.get("dtype", "fp16")), case.get("page")
    nq, new = case.get("nq", 1), case.get("new", 0)
    q = torch.randn(b, nq, h, d, dtype=dtype)
    k, v = ((torch.randn(b, new, hk, d, dtype=dtype) for _ in range(2)) if new else (None, None))
    kwargs = {"cache_seqlens": torch.tensor([37, 0, 90], dtype=torch.int32)}
    if page is None:
        entries = b + 1 if case.get("batch_idx") else b
        k_cache, v_cache = (torch.randn(entries, cap, hk, d, dtype=dtype) for _ in range(2))
    else:
        k_cache, v_cache = (torch.randn(b * cap // page + 2, page, hk, d, dtype=dtype) for _ in range(2))
        kwargs["block_table"] = torch.arange(b * cap // page, dtype=torch.int32).view(b, cap // page)
    if case.get("batch_idx"):
        kwargs["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32)
    if case.get("leftpad"):
        kwargs["cache_leftpad"] = torch.tensor([5, 0, 17], dtype=torch.int32)
    fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=call.get("causal", False),
                                  num_splits=call.get("num_splits", 0), **kwargs)


def _decode_test_calls() -> list:
    named = {**cases.DECODE_CASES, "captured in a CUDA graph": cases.DECODE_GRAPH_CASE}
    return [(f"decode {name}", functools.partial(_decode_case, *args)) for name, args in named.items()]


def _sm90_feature_test_calls() -> list:
    """tests/gpu/test_gpu_sm90_features.py's: past d = 256 the forward's Specs (rendered by the test),
    a d = 512 decoding step and an absorbed-MLA step (one spec for every layout); and packed queries
    over a paged cache; the steps under FAGEN_ARCH_FAMILY=sm90."""
    from fagen.spec import Spec

    from .peers import in_family

    calls = [(f"sm90 wide {fields}", Spec(**fields, arch_family=SM90.name)) for fields in cases.SM90_WIDE_SPECS]
    calls.append(("sm90 wide decode", functools.partial(in_family, SM90.name, _decode_case, *cases.SM90_WIDE_DECODE)))
    layout = next(iter(cases.SM90_MLA_LAYOUTS.values()))
    calls.append(("sm90 absorbed MLA", functools.partial(in_family, SM90.name, _mla_case, **layout)))
    calls.append(("sm90 paged varlen", functools.partial(in_family, SM90.name, _varlen_paged_case)))
    return calls


def _sm90_backward_row_calls() -> list:
    """tests/gpu/test_gpu_sm90_backward_rows.py's: bf16 at each of its head dims, causal or not, the
    sm90 family (deterministic and not) and the sm80 family's backward beside it."""
    from .peers import in_family

    batch, seqlen, heads = cases.SM90_BACKWARD_ROW_SMALL
    calls = []
    for d, causal in itertools.product(cases.SM90_BACKWARD_ROW_HEAD_DIMS, (False, True)):
        for family, deterministic in ((SM90.name, True), (SM90.name, False), ("sm80", False)):
            calls.append((f"sm90 backward rows d{d} causal={causal} {family} det={deterministic}", functools.partial(
                in_family, family, _dense, "bf16", d, (batch, seqlen, seqlen, heads, heads), causal=causal,
                deterministic=deterministic)))
    return calls


def _fp8_forward_row_calls() -> list:
    """tests/gpu/test_gpu_fp8_forward.py's: the e4m3 forward at each of its head dims, causal or not
    (its bf16 peer, the sm90 family's training spec, is the backward rows' own)."""
    from fagen.spec import Spec

    return [(f"fp8 forward rows d{d} causal={causal}",
             Spec(d, dtype="e4m3", arch_family=SM90.name, mask="causal" if causal else "none"))
            for d, causal in itertools.product(cases.FP8_FORWARD_ROW_HEAD_DIMS, (False, True))]


def _fp8_backward_row_calls() -> list:
    """tests/gpu/test_gpu_fp8_backward.py's with an e4m3 dO (Spec.dout_dtype), at the forward rows'
    head dims: its accuracy rule and its e4m3-dO timing (the bf16 dO's is the forward rows' spec)."""
    from fagen.spec import Spec

    return [(f"fp8 backward rows d{d} causal={causal} dO e4m3",
             Spec(d, dtype="e4m3", arch_family=SM90.name, mask="causal" if causal else "none", dout_dtype="e4m3"))
            for d, causal in itertools.product(cases.FP8_FORWARD_ROW_HEAD_DIMS, (False, True))]


def _fp8_decode_case(case: dict, call: dict) -> None:
    """flash_attn_with_kvcache over an 8-bit cache as tests/support/fp8_cache_cases.Fp8Case makes it:
    bf16 q (3 entries, 4 heads over 2 K/V heads, d 64), an e4m3 cache of 128 rows per entry
    (contiguous with cache_batch_idx and cache_leftpad, or paged), two new rows."""
    import torch

    import fagen

    batch, heads, kv_heads, d, capacity, page = 3, 4, 2, 64, 128, case.get("page")
    q = torch.randn(batch, 1, heads, d, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 2, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    kwargs = {"cache_seqlens": torch.tensor([37, 0, 90], dtype=torch.int32),
              "k_descale": torch.ones(batch, kv_heads), "v_descale": torch.ones(batch, kv_heads)}
    if page is None:
        shape = (batch + 1, capacity, kv_heads, d)
        kwargs.update(cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32),
                      cache_leftpad=torch.tensor([5, 0, 17], dtype=torch.int32))
    else:
        shape = (batch * capacity // page + 2, page, kv_heads, d)
        kwargs["block_table"] = torch.arange(batch * capacity // page, dtype=torch.int32).view(batch, -1)
    k_cache, v_cache = (torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
    fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=call.get("num_splits", 0), **kwargs)


def _fp8_decode_calls() -> list:
    return [(f"fp8 decode {name}", functools.partial(_fp8_decode_case, *args))
            for name, args in cases.FP8_DECODE_CASES.items()]


def _varlen_paged_case() -> None:
    """flash_attn_varlen_func over a paged cache as tests/support/varlen_paged_cases makes it: fp16,
    d = 64, 4 query heads over 2 K/V heads, causal, gpu_cases' page and variants."""
    import torch

    import fagen

    page, lengths = cases.SM90_VARLEN_PAGED_PAGE, [5, 40]
    cu = torch.tensor([0, 5, 45], dtype=torch.int32)
    k, v = (torch.randn(6, page, 2, 64, dtype=torch.float16) for _ in range(2))
    q = torch.randn(sum(lengths), 4, 64, dtype=torch.float16)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    fagen.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, block_table=table,
                                 alibi_slopes=torch.tensor(cases.SM90_VARLEN_PAGED_SLOPES),
                                 **cases.SM90_VARLEN_PAGED_VARIANT)


def _mla_case(page: int, num_splits: int = 0, batch: int = 2, heads: int = 16, capacity: int = 128) -> None:
    """flash_attn_with_kvcache as tests/support/kvcache_cases.check_mla makes it: one fp16 cache of
    576-wide rows in pages, V its first 512 columns, a row appended through k."""
    import torch

    import fagen

    kv = torch.randn(batch * capacity // page + 1, page, 1, 576, dtype=torch.float16)
    table = torch.arange(batch * capacity // page, dtype=torch.int32).view(batch, -1)
    q, k_new = (torch.randn(batch, rows, heads_, 576, dtype=torch.float16) for rows, heads_ in ((1, heads), (1, 1)))
    fagen.flash_attn_with_kvcache(q, kv, kv[..., :512], k_new, k_new[..., :512], block_table=table, causal=True,
                                  cache_seqlens=torch.full((batch,), 5, dtype=torch.int32), num_splits=num_splits)


def _ring_test_calls() -> list:
    from fagen.spec import Spec

    calls = [(f"ring {layout} dropout {p}", functools.partial(_ring_test, layout, p))
             for layout in cases.RING_LAYOUTS for p in cases.RING_DROPOUT_PS]
    # The plain kernels the test compares with, rendered by the test itself.
    calls += [(f"ring reference dropout {p}", Spec(cases.RING_SHAPE[-1], dtype="bf16", mask="causal", dropout=p > 0))
              for p in cases.RING_DROPOUT_PS]
    return calls


def _ring_test(layout: str, dropout_p: float) -> None:
    """ring_attention forward and backward in a world-1 gloo group, as the test (NCCL there)."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from fagen.distributed import ring_attention, shard

    batch, n, heads, kv_heads, d = cases.RING_SHAPE
    folder = tempfile.mkdtemp(prefix="fagen-record-")
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    try:
        q, k, v = (shard(torch.randn(batch, n, h, d, dtype=torch.bfloat16), layout).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        out = ring_attention(q, k, v, causal=True, layout=layout, dropout_p=dropout_p)
        out.backward(torch.randn_like(out))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)   # the file store's folder
