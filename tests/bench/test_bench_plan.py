"""The GPU check's plan on any machine: the paper's sizes, the dry run's text and checks, the
entry point by path, the FLOP count and the budget's deadlines. (The GPU run itself is
`python -m fagen.bench gpu-check`; its measurements need a GPU and are not asserted here.)"""

import os
import subprocess
import sys

import pytest

from fagen.bench.flops import attention_flops, tflops
from fagen.bench.plan import full_plan, quick_plan
from fagen.bench.schedule import estimate_line
from fagen.bench.timing import Budget, repeats_for
from fagen.bench.versions import found_versions, versions_line
from fagen.selftest.templates import all_templates

from bench_stand_ins import REPO, sum_without_the_sweep


def test_full_plan_is_the_papers_setup():
    plan = full_plan()
    assert plan.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
    assert [plan.batch(n) * n for n in plan.seqlens] == [16384] * 6
    assert (plan.heads(64), plan.heads(128)) == (32, 16)
    assert plan.timed_runs() == 8 * 6 * 3 * 8   # 8 systems x 3 passes
    assert max(plan.memory.seqlens) == 65536
    # The 8 minutes: the sweep is elastic (the time guard gives it what the others leave),
    # so what must fit the budget is every other section with the sweep at its minimum.
    assert sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert quick_plan().timed_runs() < plan.timed_runs() / 5


def test_dry_run_prints_the_plan_and_exits_zero():
    # The suite's own kernel cache: kernels other tests compiled are not compiled again.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "fagen.bench", "gpu-check", "--dry-run"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert f"timed runs: {full_plan().timed_runs()}" in out
    for needle in ("sections, in order: setup, precompile, peak, selftest, correctness, sanitizers, speed, "
                   "variants, decode, models, ring, memory, report",
                   "  selftest: python -m fagen selftest --verbose, before anything else runs the sm90 family: one "
                   f"small case per kernel template (sm80 {len(all_templates('sm80'))}, sm90 {len(all_templates('sm90'))};",
                   "[     ok] the self-test's cases for sm_90 (recorded as its child records them): "
                   f"{len(all_templates('sm80')) + len(all_templates('sm90'))} templates, each "
                   "case loading kernels of its family: sm80 23 kernels, sm90 35 kernels",
                   "[     ok] the self-test's last sm90 kernel compiles for sm_90: ",
                   "fagen v2, fagen sm90, fagen v1, SDPA flash, SDPA cuDNN, SDPA efficient, SDPA math, FlexAttention",
                   "[     ok] precompile's kernels for sm_90 (recorded from the calls): ",
                   "[     ok] the sections' reserves fit the budget (with compute-sanitizer's runs): 420 s of 420 s",
                   "[     ok] fagen flash_attn_func", "dry run: ok"):
        assert needle in out, needle
    assert out.startswith("versions found: " + versions_line(found_versions()))
    assert out.rstrip().endswith(estimate_line(full_plan(), sanitizer_found=False) + ")")
    # The variants section: its rows in the plan, and its kernels traced and one compiled.
    for needle in ("  variants: passes forward, forward + backward; bf16 d=128 causal N=16k B=1 H=16",
                   "    variant window: sliding window 4096, window_size=(W, 0)",
                   "    variant softcap: softcap 50, softcap=C",
                   "    variant alibi: ALiBi, alibi_slopes 2^(-8 i / H) fp32 (H,)",
                   "    variant document: document mask (8 docs), mask_mod doc[b, q] == doc[b, k]",
                   "    systems: fagen v2 (same mod), fagen sm90 (same mod), FlexAttention (same mod), SDPA flash "
                   "(plain causal, measured once), fagen v2 (no mod) (plain causal, measured once)",
                   f"    timed runs: {full_plan().variants.timed_runs()}; fagen variant kernels to compile: 8",
                   "[     ok] the variants section's fagen kernels compile for sm_90: "
                   "fa2_d128_causal_window_bf16_m128n128w8s2, fa2_d128_causal_softcap_bf16_m128n128w8s2, "
                   "fa2_d128_causal_alibi_bf16_m128n128w8s2, fa2_d128_causal_mmod",
                   "[     ok] the variants section's sm90 family (sm_90a) fagen kernels compile for sm_90: "
                   "fa2_d128_causal_window_bf16_sm90_m128n128w8s2, fa2_d128_causal_softcap_bf16_sm90_m128n128w8s2, "
                   "fa2_d128_causal_alibi_bf16_sm90_m128n128w8s2, fa2_d128_causal_mmod"):
        assert needle in out, needle
    assert " compiles in " in out.split("the variants section's fagen kernels")[1].splitlines()[0]
    assert "variants " in out.split("estimated seconds:")[1].splitlines()[0]
    # The decode section: its rows in the plan, its estimate, and its kernels rendered and one compiled.
    decode = full_plan().decode
    for needle in ("  decode: cap 31 s;",
                   "    decode step: bf16 B=64 cache 8k Hq=32 Hk=8 d=128 Nq=1 non-causal, full caches",
                   "    systems: fagen (flash_attn_with_kvcache, contiguous cache), fagen paged (the same keys in "
                   "pages of 256, seeded random block table), fagen fp8 cache (the contiguous cache in e4m3, one "
                   "descale per K/V head: half the cache's bytes), fagen fp8 paged (the pages in e4m3), fagen sm90 "
                   "(the contiguous cache on the sm90 family; "
                   "compute capability 9.0), sm90 paged (the pages on the sm90 family; compute capability "
                   "9.0), SDPA math, SDPA efficient, SDPA flash, FlexAttention",
                   "bytes per step: K + V read (B N Hk d, 2 B each) + q + out = 2.15 GB (K/V expanded to Hq heads: "
                   "8.59 GB)",
                   f"    document lengths (seed 0): {', '.join(map(str, decode.document_lengths()))}",
                   "    CUDA graph: bf16 B=8 cache 4k Hq=32 Hk=8 d=128 Nq=1, 1 new token with rotary, 4 splits, "
                   "causal;",
                   "    absorbed MLA at B = 64, 1: absorbed MLA, bf16 B=64 cache 8k Hq=128 Hk=1 d=576 d_v=512",
                   "    timed runs: 26; fagen kernels to compile: 9",
                   "[     ok] fagen flash_attn_with_kvcache and flash_attn_varlen_func",
                   "[     ok] the decode section's fagen kernels compile for sm_90: "):
        assert needle in out, needle
    kernels = out.split("the decode section's fagen kernels")[1].splitlines()[0]
    assert "_paged_packgqa_" in kernels and "_cache_packgqa_" in kernels and "varlen" in kernels
    assert " compiles in " in kernels
    assert " decode 31," in out.split("estimated seconds:")[1].splitlines()[0]
    # The models section: its rows in the plan, its estimate, its kernels, and the model counted.
    for needle in ("  models: cap 40 s; Hugging Face transformers, Llama 1.10B (16 layers, hidden 2048, Hq=32 Hk=8 "
                   "d=64), random weights, bf16;",
                   "    parameters: 1,104,218,112 = 2 V h",
                   "    train B=1 x N=4096: forward + loss + backward on random tokens",
                   "systems fagen (fagen.integrations.transformers), SDPA, FlexAttention (torch.compile; last, only "
                   "with >= 20 s left)",
                   "    generate: 32 prompts of 64-128 tokens, left-padded, + 32 new tokens each, greedy; new tokens/s "
                   "= 32 x 32 / call time",
                   f"    prompt lengths (seed 0): {', '.join(map(str, full_plan().models.prompt_lengths()))}",
                   "[     ok] the models section's fagen kernels compile for sm_90: fa2_d64_causal_bf16_m128n64w4s3, "
                   "fa2_d64_causal_bf16_varlen_m128n64w4s3; fa2_d64_causal_bf16_varlen_m128n64w4s3 compiles in ",
                   "[     ok] transformers and the models section's Llama (models section): transformers "):
        assert needle in out, needle
    assert "1,104,218,112 parameters (as counted)" in out
    assert " models 40," in out.split("estimated seconds:")[1].splitlines()[0]
    # The ring section: its rows in the plan, its estimate, and step_blocks' pair counts checked.
    for needle in ("  ring: cap 9 s; fagen.distributed.ring_attention in a world-1 process group (NCCL, else gloo) "
                   "on this GPU, bf16 B=1 N=16k H=16 Hk=16 d=128 causal, layouts zigzag, contiguous",
                   "the step's pair kernels summed (zigzag 3, contiguous 1)",
                   "    overlap MODEL, not measured: zigzag at W = 2, 4, 8;",
                   "over NVLink 4 450 GB/s, IB NDR 50 GB/s (assumed: vendor specs, per direction)",
                   "[     ok] fagen.distributed and the ring section's chunk pairs (step_blocks): world 1 pairs: "
                   "zigzag 3, contiguous 1; zigzag pairs per step at W = 2: 2, 4: 2, 8: 2"):
        assert needle in out, needle
    assert " models 40, ring 5, memory 20," in out.split("estimated seconds:")[1].splitlines()[0]
    assert " peak 5, selftest 33, correctness 60," in out.split("estimated seconds:")[1].splitlines()[0]


def test_main_runs_by_path_from_elsewhere(tmp_path):
    """No install step: the entry point finds fagen in the tree it lives in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(REPO / "fagen" / "bench" / "__main__.py"), "gpu-check", "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--dry-run" in run.stdout and "--quick" in run.stdout


def test_flop_formula():
    shape = dict(batch=2, heads=3, seqlen=1024, head_dim=64)
    forward = 4 * 1024 * 1024 * 64 * 3 * 2
    assert attention_flops("fwd", causal=False, **shape) == forward
    assert attention_flops("bwd", causal=False, **shape) == 2.5 * forward
    assert attention_flops("fwd_bwd", causal=False, **shape) == 3.5 * forward
    for pass_ in ("fwd", "bwd", "fwd_bwd"):
        assert attention_flops(pass_, causal=True, **shape) == attention_flops(pass_, causal=False, **shape) / 2
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        attention_flops("backward", causal=False, **shape)
    plan = full_plan()
    config = plan.configs()[0]  # bf16 d=128 non-causal
    assert plan.flops("fwd", config, 16384) == 4 * 16384**2 * 128 * 16 * 1


def test_repeats_and_budget_deadlines():
    assert repeats_for(10.0, target_ms=30, min_repeats=3, max_repeats=20) == 3
    assert repeats_for(0.1, target_ms=30, min_repeats=3, max_repeats=20) == 20
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    now[0] = 110.0
    assert budget.remaining() == 50.0
    assert budget.deadline(reserve_s=20.0).remaining() == 30.0   # end 160 - 20 = 140
    assert budget.deadline(reserve_s=20.0, cap_s=5.0).remaining() == 5.0
    late = budget.deadline(reserve_s=55.0)
    assert late.expired()
