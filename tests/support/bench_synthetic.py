"""Synthetic results of every section, as the GPU run would record them, and the short-table blocks
they print: the report's tests (tests/bench/test_bench_*.py) feed them to fagen.bench.report."""

from fagen.bench.decode.config import DecodeConfig
from fagen.bench.models.config import ModelsConfig


def synthetic_results():
    rates = {"fagen_v2": 100.0, "fagen_v1": 50.0, "sdpa_flash": 200.0, "sdpa_cudnn": 250.0}
    points = []
    for causal in (False, True):
        for seqlen in (1024, 2048):
            for pass_ in ("fwd", "bwd", "fwd_bwd"):
                results = {name: {"ms": 1.0, "tflops": rate, "host_bound": False} for name, rate in rates.items()}
                results["sdpa_math"] = {"skipped": "OOM", "oom": True}
                results["flex"] = {"skipped": "not available: triton does not import"}
                points.append({"pass": pass_, "dtype": "bf16", "head_dim": 128, "causal": causal,
                               "seqlen": seqlen, "batch": 16384 // seqlen, "heads": 16, "flops": 1e12,
                               "results": results})
    return {
        "meta": {"device": "NVIDIA H200", "plan": "synthetic"},
        "sections": {"speed": {"status": "ok", "seconds": 12.0, "note": ""}},
        "peak": {"matmul": {"what": "torch.matmul 8192x8192x8192 bfloat16", "tflops": 790.0, "ms": 1.4},
                 "copy": {"what": "device copy of 2 GiB", "tb_per_s": 4.3, "ms": 1.0}},
        "correctness": {"status": "passed", "summary": "40 passed, 8 skipped in 30.0s", "failures": [],
                        "skips": {"no backward yet": 8}, "command": "pytest -m gpu"},
        "speed": {"status": "ok", "points": points, "systems": {}, "sanity": {}},
        "memory": {"config": {"dtype": "bf16", "head_dim": 128, "heads": 16, "batch": 1},
                   "points": [{"seqlen": n, "results": {
                       "fagen_v2": {"status": "ok", "fwd_bwd_peak_bytes": n * 1e5},
                       "sdpa_math": ({"status": "ok", "fwd_bwd_peak_bytes": n * n * 64.0} if n < 4096
                                     else {"status": "OOM"})}} for n in (1024, 2048, 4096)]},
    }


def synthetic_variants():
    points = []
    rates = {"fagen_v2": 300.0, "flex": 200.0, "sdpa_flash": 400.0, "fagen_v2_nomod": 250.0}
    for case, share in (("window", 0.44), ("softcap", 1.0), ("alibi", 1.0), ("document", 0.14)):
        for pass_ in ("fwd", "fwd_bwd"):
            results = {n: {"ms": 1.0, "tflops": r, "host_bound": False} for n, r in rates.items()}
            if case == "document":
                results["flex"] = {"skipped": "skipped: FlexAttention's time allowance (70 s) is used up"}
            points.append({"pass": pass_, "variant": case, "label": f"{case} label", "dtype": "bf16",
                           "head_dim": 128, "causal": True, "seqlen": 16384, "batch": 1, "heads": 16,
                           "flops": 1e12, "visible_share": share, "results": results})
    return {"status": "ok", "note": "", "config": {"label": "bf16 d=128 causal N=16k B=1 H=16"},
            "systems": {}, "points": points,
            "sanity": {"fagen_v2": {"window": {"ok": True, "fwd_err": 1e-3, "fwd_torch_err": 2e-3}}}}


def synthetic_decode():
    from fagen.bench.decode.run import FLEX_GUARD_REASON

    d = DecodeConfig()
    expanded = "K/V expanded to 32 heads beforehand (enable_gqa refused: RuntimeError: No available kernel)"
    decode = {"part": "decode", "pass": "fwd", "label": d.decode_label, "batch": 64, "cache_len": 8192, "results": {
        "fagen": {"ms": 0.5, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "native"},
        "fagen_paged": {"ms": 0.625, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "native"},
        "sdpa_math": {"skipped": "OOM", "oom": True},
        "sdpa_efficient": {"ms": 2.0, "bytes": 8e9, "kv_heads_read": 32, "expanded": True, "gqa": expanded},
        "sdpa_flash": {"ms": 1.0, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "enable_gqa"},
        "flex": {"skipped": FLEX_GUARD_REASON}}}
    varlen = [{"part": "varlen", "pass": p, "label": d.varlen_label, "flops": flops, "results": results}
              for p, flops, results in (
                  ("fwd", 1e11, {"fagen_varlen": {"ms": 0.25, "tflops": 400.0},
                                 "fagen_padded": {"ms": 0.4, "tflops": 250.0},
                                 "sdpa_padded": {"ms": 0.5, "tflops": 200.0, "backend": "SDPA flash"}}),
                  ("fwd_bwd", 3.5e11, {"fagen_varlen": {"ms": 1.0, "tflops": 350.0},
                                       "fagen_padded": {"ms": 1.4, "tflops": 250.0},
                                       "sdpa_padded": {"skipped": "RuntimeError: boom"}}))]
    return {"status": "ok", "note": "", "copy": {"tb_per_s": 5.0, "source": "the peak section's device copy"},
            "config": {"lengths": d.document_lengths(), "padded": list(d.padded_shape())},
            "bytes_note": "K and V read + q + out", "systems": {}, "points": [decode] + varlen,
            "graph": {"label": d.graph_label, "equal": {"ok": True, "max_err": 0.0},
                      "replay": {"ms": 0.05, "host_ms": 0.01}, "eager": {"ms": 0.2, "host_ms": 0.2},
                      "replay/eager": 0.25},
            "sanity": {"fagen": {"ok": True, "fwd_err": 1e-3, "fwd_torch_err": 2e-3},
                       "fagen_varlen": {"ok": False, "fwd_err": 9e-2, "fwd_torch_err": 2e-3}}}


SYNTHETIC_DECODE_TABLE = """\
-- decode bf16 B=64 cache 8k Hq=32 Hk=8 d=128 Nq=1 non-causal; copy 5.00 TB/s; SANITY FAILED: fagen varlen
system             ms GB/step   TB/s of copy
fagen           0.500    2.00   4.00     80%
fagen paged     0.625    2.00   3.20     64%
SDPA math      skipped: OOM
SDPA efficient  2.000    8.00   4.00     80% K/V expanded
SDPA flash      1.000    2.00   2.00     40%
FlexAttention  skipped: time guard (the section's deadline was reached) (too...
-- varlen bf16 16k tokens in 10 docs (max 2362) H=16 d=128 causal; TFLOP/s of the documents' causal FLOPs
system          fwd ms TFLOP/s  f+b ms TFLOP/s | varlen/this  fwd  f+b
fagen varlen     0.250   400.0   1.000   350.0 |                -    -
fagen padded     0.400   250.0   1.400   250.0 |             1.60 1.40
SDPA padded      0.500   200.0       -       - |             2.00    - (SDPA flash)
-- decode graph: equal, 0.050 ms vs eager 0.200 ms (0.25x)"""


def synthetic_models():
    from fagen.bench.models.run import FLEX_GUARD_REASON
    from fagen.bench.models.markdown import decode_label, model_label, train_label

    m = ModelsConfig()
    train = {"part": "train", "label": train_label(m), "results": {
        "fagen": {"ms": 100.0, "tokens": 4096, "loss": 10.4321},
        "sdpa": {"ms": 125.0, "tokens": 4096, "loss": 10.4325},
        "flex_attention": {"skipped": FLEX_GUARD_REASON}}}
    decode = {"part": "decode", "label": decode_label(m), "results": {
        "fagen": {"ms": 1280.0, "tokens": 1024, "new_tokens": 32, "same_tokens_as_sdpa": 0.97},
        "sdpa": {"ms": 1024.0, "tokens": 1024, "new_tokens": 32}}}
    return {"status": "ok", "note": "", "transformers": "5.18.0", "not_run": 1, "rows": [train, decode],
            "config": {"model": model_label(m), "parameters": m.parameter_count(), "prompt_lengths": [128, 64]},
            "sanity": {"logits": {"ok": True, "fwd_err": 0.13, "fwd_torch_err": 0.12, "shape": "B=2 N=256, 2 layers"},
                       "logits, left-padded": {"ok": False, "fwd_err": 5.0, "fwd_torch_err": 0.12,
                                               "shape": "B=2 N=256, 2 layers"}}}


SYNTHETIC_MODELS_TABLE = """\
-- models (transformers 5.18.0): Llama 1.10B (16 layers, hidden 2048, Hq=32 Hk=8 d=64), random weights, bf16; \
SANITY FAILED: logits, left-padded
train B=1 x N=4096: forward + loss + backward
  system               ms  tokens/s fagen/this
  fagen             100.0     40960          -
  SDPA              125.0     32768       1.25
  FlexAttention  skipped: time guard (the section's deadline was reached) ...
generate: 32 prompts of 64-128 tokens, left-padded, + 32 new tokens each, greedy
  system               ms new tok/s fagen/this
  fagen            1280.0       800          -
  SDPA             1024.0      1000       0.80"""


def synthetic_ring():
    from fagen.bench.ring.config import RingConfig, overlap_row

    c = RingConfig()
    rows = [{"world": 2, "chunk": 4096, **overlap_row(2, 2.0, 0.4, c.kv_bytes(2), c.links)},
            {"world": 4, "chunk": 2048, **overlap_row(4, 2.0, 0.12, c.kv_bytes(4), c.links)},
            {"world": 8, "chunk": 1024, "skipped": "time guard (the section's deadline was reached)"}]
    return {"status": "failed", "note": "", "backend": "nccl", "plain": {"ms": 3.2},
            "config": {"label": c.label, "cap_s": 20.0},
            "layouts": {"zigzag": {"equal": {"ok": True, "max_err": 0.0039, "tol": 0.0625}, "ring": {"ms": 3.36},
                                   "pairs": {"ms": 3.28, "count": 3}},
                        "contiguous": {"equal": {"ok": False, "max_err": 0.5, "tol": 0.0625},
                                       "ring": {"skipped": "RuntimeError: launch failed"},
                                       "pairs": {"ms": 3.2, "count": 1}}},
            "model": {"label": "model, not measured", "links": dict(c.links), "rows": rows}}


SYNTHETIC_RING_TABLE = """\
-- ring, world 1 (nccl): bf16 B=1 N=16k H=16 Hk=16 d=128 causal; plain 3.200 ms
zigzag     ok     err 3.9e-03 tol 6.2e-02; ring 3.360 ms 1.05x; 3 pairs 3.280 ms 1.02x
contiguous FAILED err 5.0e-01 tol 6.2e-02; ring -; 1 pairs 3.200 ms 1.00x; skipped: RuntimeError: launch failed
MODEL, not measured (zigzag step): compute ms | transfer ms (overlap) over NVLink 4 450, IB NDR 50 GB/s (assumed)
  W=2 0.800 | 0.149 (1.00), 1.342 (0.60); W=4 0.240 | 0.075 (1.00), 0.671 (0.36); W=8 skipped: time guard (the..."""
