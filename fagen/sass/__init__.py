"""Reading machine code on a CPU: the main loop's steady-state instructions per tensor-core op.

FlashAttention-2's optimisation target is the non-matmul work per tensor-core instruction.
`fagen sass` measures it from a kernel's SASS (`cuobjdump -sass`, no GPU needed):

- listing.py: `cuobjdump -sass` (PATH or its PyPI wheel), the listing as functions of instructions;
- facts.py: whole-kernel facts (tensor-core ops in loops, ldmatrix, 128-bit accesses), sm_90a's limits;
- cfg.py: basic blocks, dominators, natural loops;
- classes.py: instruction classes (HMMA, LDSM, LDGSTS, BAR, SHFL, MUFU, fp32, integer, ...);
- steady_state.py: one steady-state iteration of the main loop;
- roles.py: a warp-specialised kernel's loop per role (consumer, producer, writer), its setmaxnreg;
- overlap.py: the main loop's exp2 issued while a wgmma group is in flight;
- report.py: per-kernel reports against the useful HMMA count of the kernel's tiles.
"""

from .report import KernelGeometry, KernelReport, analyse_function

__all__ = ["KernelGeometry", "KernelReport", "analyse_function"]
