"""The ring section: context parallelism (fagen.distributed) on the one GPU there is.

A single-rank process group (world 1): ring_attention's one step runs every chunk pair of the
layout here, with no communication, so its output must equal fagen.flash_attn_func's and its
time the plain kernel's (the pair kernels of the step, timed one by one and summed, are the
"per-step kernel time"). Multi-GPU scaling is out of reach on one GPU: the section records a
model of the transfer/compute overlap at larger worlds (`overlap_row`) from kernel times
measured here and assumed link bandwidths.

config    the sizes, layouts, modelled worlds and links, and the forecast (RingConfig); the
          overlap model's arithmetic and the equality tolerance
run       the world-1 group, equality and timing per layout, the overlap model's rows; the
          step's chunk pairs from fagen.distributed's step_blocks (and the dry run's check of them)
markdown  its lines in the plan, its derived ratios, its short-table rows and results.md

config and markdown are torch-free (markdown works from the section's dict alone); run imports
torch and fagen inside its functions. fagen.distributed is reached through the front door
(`import fagen`): only fagen itself imports it (tests/top/test_layering.py). Fails soft: every
failure is a recorded reason.
"""
