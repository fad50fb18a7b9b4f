"""Instruction classes: what each SASS opcode costs in the main loop's accounting.

The classes of the `fagen sass` report: the tensor-core ops (HMMA, and Hopper's warpgroup
HGMMA) and the data movement that feeds them (LDSM, LDGSTS), synchronisation (BAR), the
softmax's shuffles and special functions (SHFL, MUFU), plain arithmetic split by datapath
(fp32, integer/address), control flow (Hopper's mbarrier SYNCS, WARPGROUP arrive/depbar and
USETMAXREG among it), local memory (spills), other memory traffic (TMA's UTMALDG/UTMASTG and
the bulk copies among it), and the rest. Instructions guarded by `@!PT` never execute but are
issued (ptxas's fillers); they count as `other`.

Tensor-core work is counted in HMMA-equivalents (`tensor_equivalents`): an m16n8k16 HMMA is
one; one warpgroup `HGMMA.64xNxK` is N/8 per warp for K = 16 (each of its four warps does a
16 x N x 16 product, N/8 m16n8k16's). An 8-bit wgmma is `QGMMA.64xNx32` in SASS: it belongs to
the HGMMA class and counts N/4, by its FLOPs (issue 45's rule; FlashAttention-3's e4m3 cubins
read this way).
"""

from __future__ import annotations

import re

from .listing import Instruction

CLASSES = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "BAR", "SHFL", "MUFU", "fp32", "integer", "control", "local", "memory",
           "other")
TENSOR_CLASSES = ("HMMA", "HGMMA")

_OWN_CLASS = {"HMMA": "HMMA", "HGMMA": "HGMMA", "QGMMA": "HGMMA", "LDSM": "LDSM", "LDGSTS": "LDGSTS", "BAR": "BAR",
              "SHFL": "SHFL", "MUFU": "MUFU"}
FP32 = frozenset({"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND", "FSWZADD", "F2F",
                  "F2FP", "F2I", "I2F", "I2FP", "F2IP", "HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "HSET2"})
INTEGER = frozenset({"IMAD", "IADD3", "IADD", "IADD32I", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP", "LOP32I", "ISETP",
                     "ICMP", "SEL", "IMNMX", "IABS", "POPC", "FLO", "BREV", "PRMT", "MOV", "MOV32I", "IMUL", "VIADD",
                     "VIMNMX", "VIADDMNMX", "I2I", "SGXT", "BMSK", "P2R", "R2P", "PLOP3", "CS2R", "S2R", "S2UR",
                     "LDC", "R2UR", "VOTE", "VOTEU", "IDP", "IMNMX3", "ISCADD", "XMAD", "BFE", "BFI", "SHFL_IDX"})
CONTROL = frozenset({"BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "WARPSYNC", "YIELD", "NOP", "DEPBAR", "LDGDEPBAR",
                     "BRX", "JMP", "JMX", "BPT", "NANOSLEEP", "BMOV", "BREAK", "KILL", "ERRBAR", "MEMBAR", "CCTL",
                     "ACQBULK", "ARRIVES", "SYNCS", "ELECT", "ENDCOLLECTIVE", "WARPGROUP", "USETMAXREG"})
LOCAL = frozenset({"LDL", "STL"})
MEMORY = frozenset({"LDG", "STG", "LDS", "STS", "LD", "ST", "RED", "REDG", "REDUX", "ATOM", "ATOMG", "ATOMS",
                    "LDSM", "STSM", "LDGMC", "REDAS", "UBLKCP", "UBLKRED", "UBLKPF", "UTMALDG", "UTMASTG",
                    "UTMAPF", "UTMAREDG"})
# Warpgroup tensor-core products: HGMMA (16-bit inputs; tf32 too), QGMMA (8-bit: e4m3, e5m2).
WARPGROUP_MMA = frozenset({"HGMMA", "QGMMA"})
_WARPGROUP_SHAPE = re.compile(r"[HQ]GMMA\.64x(\d+)x(\d+)")


def classify(instruction: Instruction) -> str:
    if instruction.never:
        return "other"
    base = instruction.base
    if base in _OWN_CLASS:
        return _OWN_CLASS[base]
    if base in FP32:
        return "fp32"
    if base in INTEGER or (base.startswith("U") and base not in MEMORY | CONTROL):   # the uniform datapath: scalars
        return "integer"
    if base in CONTROL:
        return "control"
    if base in LOCAL:
        return "local"
    if base in MEMORY:
        return "memory"
    return "other"


def tensor_equivalents(instruction: Instruction) -> float:
    """The m16n8k16 HMMAs per warp an instruction is worth: 1 for an HMMA, N/8 * K/16 for a
    warpgroup HGMMA.64xNxK or QGMMA.64xNx32, 0 for anything else (and for one that never executes)."""
    if instruction.never:
        return 0.0
    if instruction.base == "HMMA":
        return 1.0
    if instruction.base in WARPGROUP_MMA:
        shape = _WARPGROUP_SHAPE.match(instruction.opcode)
        if shape is None:
            raise ValueError(f"a warpgroup MMA without its 64xNxK shape: {instruction}")
        return int(shape.group(1)) / 8 * int(shape.group(2)) / 16
    return 0.0
