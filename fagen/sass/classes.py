"""Instruction classes: what each SASS opcode costs in the main loop's accounting.

The classes of the `fagen sass` report: the tensor-core op and the data movement that
feeds it (HMMA, LDSM, LDGSTS), synchronisation (BAR), the softmax's shuffles and special
functions (SHFL, MUFU), plain arithmetic split by datapath (fp32, integer/address),
control flow, local memory (spills), other memory traffic, and the rest. Instructions
guarded by `@!PT` never execute but are issued (ptxas's fillers); they count as `other`.
"""

from __future__ import annotations

from .listing import Instruction

CLASSES = ("HMMA", "LDSM", "LDGSTS", "BAR", "SHFL", "MUFU", "fp32", "integer", "control", "local", "memory",
           "other")

_OWN_CLASS = {"HMMA": "HMMA", "LDSM": "LDSM", "LDGSTS": "LDGSTS", "BAR": "BAR", "SHFL": "SHFL", "MUFU": "MUFU"}
FP32 = frozenset({"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND", "FSWZADD", "F2F",
                  "F2FP", "F2I", "I2F", "I2FP", "F2IP", "HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "HSET2"})
INTEGER = frozenset({"IMAD", "IADD3", "IADD", "IADD32I", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP", "LOP32I", "ISETP",
                     "ICMP", "SEL", "IMNMX", "IABS", "POPC", "FLO", "BREV", "PRMT", "MOV", "MOV32I", "IMUL", "VIADD",
                     "VIMNMX", "VIADDMNMX", "I2I", "SGXT", "BMSK", "P2R", "R2P", "PLOP3", "CS2R", "S2R", "S2UR",
                     "LDC", "R2UR", "VOTE", "VOTEU", "IDP", "IMNMX3", "ISCADD", "XMAD", "BFE", "BFI", "SHFL_IDX"})
CONTROL = frozenset({"BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "WARPSYNC", "YIELD", "NOP", "DEPBAR", "LDGDEPBAR",
                     "BRX", "JMP", "JMX", "BPT", "NANOSLEEP", "BMOV", "BREAK", "KILL", "ERRBAR", "MEMBAR", "CCTL",
                     "ACQBULK", "ARRIVES", "SYNCS", "ELECT", "ENDCOLLECTIVE", "WARPGROUP"})
LOCAL = frozenset({"LDL", "STL"})
MEMORY = frozenset({"LDG", "STG", "LDS", "STS", "LD", "ST", "RED", "REDG", "REDUX", "ATOM", "ATOMG", "ATOMS",
                    "LDSM", "STSM", "LDGMC", "REDAS", "UBLKCP", "UTMALDG", "UTMASTG"})


def classify(instruction: Instruction) -> str:
    if instruction.never:
        return "other"
    base = instruction.base
    if base in _OWN_CLASS:
        return _OWN_CLASS[base]
    if base in FP32:
        return "fp32"
    if base in INTEGER or (base.startswith("U") and base not in MEMORY):   # the uniform datapath: scalars
        return "integer"
    if base in CONTROL:
        return "control"
    if base in LOCAL:
        return "local"
    if base in MEMORY:
        return "memory"
    return "other"
