"""fagen.bench: the one-command GPU check (`python -m fagen.bench gpu-check --out DIR`).

A GPU is lent only now and then, for minutes, on a machine with no package
registry. This package turns such a lease into one prepared run that:

  1. runs the `gpu` tests (correctness on the hardware) as a subprocess,
  2. times fagen v2 and v1 side by side with PyTorch's attention backends and
     FlexAttention, in TFLOP/s counted the FlashAttention-2 paper's way,
  3. times fagen's attention variants (sliding window, softcap, ALiBi, a document
     mask_mod) against FlexAttention with the same mod and against plain causal
     attention (fagen's and SDPA flash's),
  4. times a decoding step against a KV cache (contiguous and paged; TB/s as a share of
     the measured copy bandwidth) and varlen causal training against a padded batch,
     beside PyTorch's backends and FlexAttention,
  5. measures peak memory against sequence length,
  6. writes results.json, results.md and a few PNG plots into DIR,
  7. runs compute-sanitizer's memcheck and racecheck when it is installed,

all under one time budget, failing soft: a peer or section that cannot run is
recorded with its reason, never a crash. Modules, one concern each:

  plan        what runs: sizes, systems, sections, caps (plan_text: the plan as text)
  schedule    the time guard's arithmetic: reserves, deadlines, the forecast replayed under it
  flops       the paper's FLOP count
  timing      CUDA-event timing and the time budget (the guard)
  peers       the systems compared: fagen v1/v2, SDPA backends, FlexAttention
  sweep       the speed sweep over (config, sequence length, pass, system)
  variants    the variants section: each variant in fagen and Flex, and the no-mod peers
  decode      the decode section: a KV-cache decoding step, and varlen training vs padding
  decode_report  the decode section's bandwidth, ratios, short-table rows and Markdown
  memory      peak GPU memory against sequence length
  correctness the `gpu` pytest run and the compute-sanitizer runs
  report      JSON, Markdown, PNG plots and the short printed table
  precompile  the kernels the calls will load, recorded (kernel_record, over kernel_calls'
              small calls; gpu_cases: the gpu tests' tables), compiled in parallel
  gpu_check   the sections in order, and writing as it goes (dry_run: --dry-run; versions:
              what the run finds installed)
"""
