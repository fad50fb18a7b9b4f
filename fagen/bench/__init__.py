"""fagen.bench: the one-command GPU check (`python -m fagen.bench gpu-check --out DIR`).

A GPU is lent only now and then, for minutes, on a machine with no package
registry. This package turns such a lease into one prepared run that:

  1. runs `fagen selftest` (what a user's first call runs: every kernel template of the GPU's
     families, held to flash-attn's rule) and the `gpu` tests (correctness on the hardware)
     as subprocesses,
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
recorded with its reason, never a crash.

Each section's config (its dataclass, sizes and forecast), its run and its text (its lines in the
plan, its rows of the short table, its results.md tables) live in the section's own module, or in
a subpackage of config / run / markdown where one module would be too long:

  speed/      the sweep over (panel, sequence length, system, pass), against the best peer
  variants/   each variant in fagen and Flex, and the no-mod peers
  decode/     a KV-cache decoding step (and the step captured in a CUDA graph), and varlen
              training against padding (config, step, graph, varlen, run, markdown)
  models/     a Llama in transformers: a training step and generate per system
  ring/       ring attention in a world-1 group, and the overlap model (config, run, markdown)
  memory.py   peak GPU memory against sequence length
  selftest_step.py  `fagen selftest` under a cap, its verdicts per template
  correctness.py  the `gpu` pytest run (the families pinned) and the compute-sanitizer runs
  precompile.py   the kernels the calls will load, recorded (kernel_record, over kernel_calls'
              small calls; gpu_cases: the gpu tests' tables), compiled in parallel
  peak.py     the matmul peak and the copy bandwidth

and what puts them together, or what they share:

  plan        the sections in order, composed into one Plan with the run's budget and caps
              (plan_text: the plan as text, each section's lines in order)
  schedule    the time guard's arithmetic: reserves, deadlines, the forecast replayed under it
  report      results.json, results.md, the plots and the short table, each section's part in order
  gpu_check   the sections in order, and writing as it goes (dry_run: --dry-run; versions:
              what the run finds installed)
  peers       the systems compared: fagen v1/v2, SDPA backends, FlexAttention
  measure     inputs, one timed cell, the sanity check against torch, the guard's reasons
  timing      CUDA-event timing and the time budget (the guard)
  flops, sizes, markdown, figures   the paper's FLOP count, document lengths, text and plot pieces
"""
