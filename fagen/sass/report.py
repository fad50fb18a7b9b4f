"""Per-kernel SASS reports: the main loop's steady-state instructions per useful HMMA.

The main loop is the natural loop with the most HMMA in its own blocks (a loop nested
in it runs inside its iterations). One steady-state iteration of it
(steady_state.py) is divided by the iteration's useful HMMA per warp,

    useful = gemms * block_m * block_n * d / 2048 / warps

(2 GEMMs forward, S = Q K^T and O += P V; 5 backward, S, dP, dV, dK and dQ; those of V's
side, O, dP and dV, step over d_v where V's head dim differs; an m16n8k16
HMMA does 16 * 8 * 16 = 2048 multiply-adds), so kernels with different tiles compare on
FlashAttention-2's own measure: non-matmul instructions per tensor-core instruction.

A warp-specialised kernel's report also reads each role's loop (roles.py: the consumer's is
the main loop), the `setmaxnreg` each role runs under, and the main loop's overlap
signature (overlap.py: the exp2 issued while a wgmma group is in flight); `limit_problems`
checks it against the arch's limits (facts.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .cfg import build_graph
from .classes import CLASSES, TENSOR_CLASSES, tensor_equivalents
from .facts import ARCH_LIMITS, SHARED_RESERVED_PER_BLOCK, SM_LIMITS, limit_problems
from .listing import Instruction, parse_listing
from .overlap import Overlap, exp2_overlap
from .roles import RegisterSetting, RoleLoop, find_roles, register_settings
from .steady_state import steady_iteration

MMA_MACS = 16 * 8 * 16


@dataclass(frozen=True)
class KernelGeometry:
    """What one main-loop iteration of a kernel does, from its tiles.

    `rows` x `cols` is the score tile one iteration covers (forward: block_m queries x
    block_n keys; backward: block_m queries x block_n keys of the K/V block), `head_dim`
    the padded d the mma steps over, `copied_bytes` what the iteration brings into shared
    memory with cp.async (the next tiles: K and V forward, Q and dO backward)."""

    gemms: int
    rows: int
    cols: int
    head_dim: int
    warps: int
    copied_bytes: int
    executed_hmma: int | None = None   # the kernel's own mma per warp and iteration, if it differs
    v_gemms: int = 0                   # of the gemms, those over V's head dim (O, dP, dV) ...
    head_dim_v: int = 0                # ... d_v, padded as head_dim is (0: head_dim)

    @property
    def useful_hmma(self) -> float:
        d_v = self.head_dim_v or self.head_dim
        width = (self.gemms - self.v_gemms) * self.head_dim + self.v_gemms * d_v
        return self.rows * self.cols * width / MMA_MACS / self.warps

    @property
    def expected_ldgsts(self) -> int:
        return self.copied_bytes // 16 // (32 * self.warps)


@dataclass
class KernelReport:
    kernel: str
    arch: str
    counts: Counter                     # instruction class -> per steady-state iteration, per warp
    useful_hmma: float
    expected_ldgsts: int | None
    loop_address: int | None            # the main loop's header
    visits: Counter = field(default_factory=Counter)    # block address -> runs per iteration
    trips: dict = field(default_factory=dict)           # nested loop header -> trip count
    opcodes: Counter = field(default_factory=Counter)   # opcode (with modifiers) -> per iteration
    tensor_ops: float = 0.0                                  # HMMA-equivalents per iteration
    problem: str = ""                                        # why no iteration was read (a peer's cubin)
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None     # dynamic + static, per block
    threads: int | None = None
    roles: dict[str, RoleLoop] = field(default_factory=dict)              # a warp-specialised kernel's
    register_settings: list[RegisterSetting] = field(default_factory=list)   # its USETMAXREGs
    overlap: Overlap | None = None      # the main loop's exp2 under wgmma (a loop with HGMMA)

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    @property
    def hmma(self) -> int:
        return self.counts["HMMA"]

    @property
    def non_tensor(self) -> int:
        """Instructions of the iteration other than tensor-core ops (HMMA, HGMMA)."""
        return self.instructions - sum(self.counts.get(c, 0) for c in TENSOR_CLASSES)

    @property
    def non_hmma_per_useful_hmma(self) -> float | None:
        if not self.useful_hmma:
            return None
        return self.non_tensor / self.useful_hmma

    @property
    def non_tensor_per_tensor_op(self) -> float | None:
        """Per HMMA-equivalent the iteration executes (any kernel, no geometry needed: a peer's
        cubin); for fagen's own kernels `non_hmma_per_useful_hmma` divides by the useful ones."""
        return self.non_tensor / self.tensor_ops if self.tensor_ops else None

    @property
    def warps_per_sm(self) -> int | None:
        return occupancy(self.arch, self.registers, self.shared_bytes, self.threads)

    def limit_problems(self, warpgroups: dict[str, int] | None = None) -> list[str]:
        """What the kernel asks beyond its arch's limits (facts.ARCH_LIMITS; none known: []).
        `warpgroups` (role -> warpgroups running it, where the caller knows them) adds the
        check that the roles' setmaxnreg budgets fit the register file together; the roles
        one setting governs share its warpgroups (a producer's and a writer's warps are one
        warpgroup), so a setting counts the most warpgroups of its roles."""
        limits = ARCH_LIMITS.get(self.arch)
        if limits is None:
            return []
        budgets = []
        for setting in self.register_settings:
            groups = max((warpgroups or {}).get(role, 0) for role in setting.roles) if setting.roles else 0
            if groups:
                budgets.append((setting.registers, groups))
        return limit_problems(limits, registers=self.registers, shared_bytes=self.shared_bytes,
                              setmaxnreg=tuple(s.registers for s in self.register_settings), budgets=tuple(budgets))

    def to_json(self) -> dict:
        data = {"kernel": self.kernel, "arch": self.arch, "instructions": self.instructions, "hmma": self.hmma,
                "useful_hmma": self.useful_hmma, "non_hmma_per_useful_hmma": self.non_hmma_per_useful_hmma,
                "registers": self.registers, "spill_bytes": self.spill_bytes, "shared_bytes": self.shared_bytes,
                "warps_per_sm": self.warps_per_sm, "expected_ldgsts": self.expected_ldgsts,
                "tensor_ops": self.tensor_ops, "non_tensor_per_tensor_op": self.non_tensor_per_tensor_op,
                "main_loop": None if self.loop_address is None else f"{self.loop_address:#06x}",
                "trips": {f"{k:#06x}": v for k, v in self.trips.items()},
                "roles": {role: loop.to_json() for role, loop in self.roles.items()},
                "setmaxnreg": [s.to_json() for s in self.register_settings],
                "overlap": None if self.overlap is None else self.overlap.to_json(),
                "limit_problems": self.limit_problems()}
        data.update({name: self.counts.get(name, 0) for name in CLASSES})
        return data


def occupancy(arch: str, registers: int | None, shared_bytes: int | None, threads: int | None) -> int | None:
    """Resident warps per SM, from registers (allocated per warp in units of 256), shared
    memory (plus the per-block reservation) and the thread limits."""
    if arch not in SM_LIMITS or None in (registers, shared_bytes, threads):
        return None
    smem, regfile, max_warps, max_blocks = SM_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    blocks = min(max_blocks, max_warps // warps, regfile // (per_warp * warps),
                 smem // (shared_bytes + SHARED_RESERVED_PER_BLOCK))
    return blocks * warps


def analyse_function(name: str, instructions: list[Instruction], arch: str,
                     geometry: KernelGeometry | None) -> KernelReport:
    """The report of one function: its main loop's steady-state iteration against `geometry`
    (None: instructions only, no per-HMMA figures)."""
    graph = build_graph(instructions)
    expected = geometry.expected_ldgsts if geometry else None
    useful = geometry.useful_hmma if geometry else 0.0

    def own_hmma(loop):   # tensor-core work in the loop's own blocks, not in the loops nested in it
        nested = set().union(*(child.body for child in loop.children)) if loop.children else set()
        return sum(tensor_equivalents(i) for b in loop.body - nested for i in graph.blocks[b].instructions)

    loops = [loop for loop in graph.loops if own_hmma(loop) > 0]
    if not loops:
        return KernelReport(name, arch, Counter(), useful, expected, None)
    # The most tensor work of its own; on a tie the innermost loop: an outer loop that holds as
    # much is one whose body peels an iteration around it (FlashAttention-3's consumer loop
    # inside its persistent tile loop), and the steady state is the inner one.
    main = max(loops, key=lambda loop: (own_hmma(loop), loop.depth))
    iteration = steady_iteration(graph, main, expected, geometry.executed_hmma if geometry else None)
    by_start = {block.start: block for block in graph.blocks}
    opcodes = Counter()
    for start, times in iteration.visits.items():
        for instruction in by_start[start].instructions:
            opcodes[instruction.opcode] += times
    roles = find_roles(graph, main, iteration)
    overlap = None
    if iteration.counts["HGMMA"]:   # HMMA is synchronous: nothing is in flight
        overlap = exp2_overlap([i for start in iteration.path for i in by_start[start].instructions])
    return KernelReport(name, arch, iteration.counts, useful, expected, graph.blocks[main.header].start,
                        iteration.visits, iteration.trips, opcodes, iteration.tensor_ops,
                        roles=roles, register_settings=register_settings(graph, roles), overlap=overlap)


def analyse_listing(sass: str, arch: str, geometries: dict[str, KernelGeometry | None]) -> dict[str, KernelReport]:
    functions = parse_listing(sass)
    return {name: analyse_function(name, functions[name], arch, geometry)
            for name, geometry in geometries.items() if name in functions}


# -- fagen's own kernels -------------------------------------------------------------------------

def spec_geometries(spec, entries) -> dict[str, KernelGeometry | None]:
    """Each kernel of a rendered spec and its main loop's geometry (None: no tensor-core loop
    to measure, e.g. the backward's pre-pass and dQ conversion)."""
    geometries: dict[str, KernelGeometry | None] = {e.name: None for e in entries.all}
    d, dv = spec.head_dim_pad, spec.head_dim_v_pad
    if spec.version == 2:   # the K/V loop: K_j and V_j arrive per iteration
        geometries[entries.forward.name] = KernelGeometry(2, spec.block_m, spec.block_n, d, spec.num_warps,
                                                          spec.block_n * (d + dv) * 2, v_gemms=1, head_dim_v=dv)
    else:                   # FA-1's inner Q loop: Q_i arrives per iteration, K_j and V_j stay
        geometries[entries.forward.name] = KernelGeometry(2, spec.block_m, spec.block_n, d, spec.num_warps,
                                                          spec.block_m * d * 2)
    if entries.bwd_main is None:   # kv_cache specs: forward only (their other kernels have no mma)
        return geometries
    t = spec.backward_tiles
    bd, bdv = t.head_dim_pad, t.head_dim_v_pad
    # The backward's own mma per warp: S^T (over d) and dP^T (over d_v) by every warp of a key
    # group (dim_split warps share one), dK and dV over the warp's d and d_v slices, and dQ
    # (not in the deterministic spec's main kernel) shared by all warps.
    gemms = 4 if spec.deterministic else 5
    executed = t.block_m * (bd + bdv) * t.key_tiles // 128 + t.block_m * (bd + bdv) * t.key_tiles // (128 * t.dim_split)
    if not spec.deterministic:
        executed += t.block_m * t.block_n * bd // (MMA_MACS * t.num_warps)
    geometries[entries.bwd_main.name] = KernelGeometry(gemms, t.block_m, t.block_n, bd, t.num_warps,
                                                       t.block_m * (bd + bdv) * 2, executed, v_gemms=2, head_dim_v=bdv)
    if entries.bwd_dq is not None:   # the deterministic dQ pass: K_j, V_j per iteration; S, dP and dQ
        warps = t.block_m // 16 * spec.column_split
        geometries[entries.bwd_dq.name] = KernelGeometry(3, t.block_m, t.dq_block_n, d, warps,
                                                         t.dq_block_n * (d + dv) * 2, v_gemms=1, head_dim_v=dv)
    return geometries


def report_for_spec(spec, arch: str) -> dict[str, KernelReport]:
    """Compile a spec for `arch` (through the cache), disassemble it and report each kernel."""
    from ..kernels.render import render
    from ..kernels.compile import compile_source
    from .listing import disassemble

    source = render(spec)
    compiled = compile_source(source, arch)
    reports = analyse_listing(disassemble(*compiled.cubins), arch, spec_geometries(spec, source.kernels))
    for entry in source.entries:
        report, resources = reports.get(entry.name), compiled.resources.get(entry.name)
        if report is None or resources is None:
            continue
        report.registers, report.spill_bytes = resources.registers, resources.spill_bytes
        report.shared_bytes = entry.shared_bytes + resources.static_shared_bytes
        report.threads = entry.threads
    return reports


# -- the `fagen sass` table -------------------------------------------------------------------------

def format_reports(reports: dict[str, KernelReport], *, opcodes: bool = False) -> str:
    lines = [f"{'kernel':<34} {'loop':>7} {'instr':>6} {'HMMA':>5} {'useful':>7} {'non-HMMA/useful':>15} "
             f"{'regs':>5} {'spill':>5} {'smem':>7} {'warps/SM':>8}"]
    for name, r in reports.items():
        if r.loop_address is None:
            lines.append(f"{name:<34} {'-':>7} {'(no tensor-core loop)':>37} {r.registers or '':>5} "
                         f"{r.spill_bytes or 0:>5} {r.shared_bytes or 0:>7} {r.warps_per_sm or '':>8}")
            continue
        per = r.non_hmma_per_useful_hmma
        lines.append(f"{name:<34} {r.loop_address:#7x} {r.instructions:>6} {r.hmma:>5} {r.useful_hmma:>7g} "
                     f"{per if per is None else f'{per:.2f}':>15} {r.registers or '':>5} {r.spill_bytes or 0:>5} "
                     f"{r.shared_bytes or 0:>7} {r.warps_per_sm or '':>8}")
        lines.append("    " + "  ".join(f"{c} {r.counts.get(c, 0)}" for c in CLASSES)
                     + (f"   (nested loop trips: {', '.join(f'{a:#x}: {t}' for a, t in sorted(r.trips.items()))})"
                        if r.trips else ""))
        if opcodes:
            for opcode, n in sorted(r.opcodes.items(), key=lambda item: (-item[1], item[0])):
                lines.append(f"        {n:>5}  {opcode}")
        lines.extend(format_roles(r))
    return "\n".join(lines)


def format_roles(r: KernelReport, warpgroups: dict[str, int] | None = None) -> list[str]:
    """A warp-specialised kernel's roles, each loop's iteration and its setmaxnreg; the main
    loop's overlap signature; what exceeds the arch's limits. Nothing for a kernel with none."""
    lines = []
    for role, loop in r.roles.items():
        per = loop.non_tensor_per_tensor_op
        lines.append(f"    {role:<8} loop {loop.loop_address:#x}: {loop.instructions} instr"
                     + ("" if per is None else f", {loop.tensor_ops:g} HMMA-eq, {per:.2f} non-tensor/HMMA-eq")
                     + ("" if loop.registers is None else f", setmaxnreg {loop.registers}"))
        lines.append("        " + "  ".join(f"{c} {loop.counts[c]}" for c in CLASSES if loop.counts.get(c))
                     + ("   (" + ", ".join(f"{op} {n}" for op, n in sorted(loop.work.items())) + ")"
                        if loop.work else ""))
    if r.register_settings:
        lines.append("    setmaxnreg: " + ", ".join(f"{s.registers} ({s.kind} at {s.address:#x}: "
                                                     f"{', '.join(s.roles) or 'no role loop'})"
                                                     for s in r.register_settings))
    if r.overlap is not None:
        o = r.overlap
        lines.append(f"    overlap: {o} ({o.groups} wgmma groups per iteration, {o.carried} carried in)")
    problems = r.limit_problems(warpgroups)
    if problems:
        lines.append(f"    beyond {r.arch}'s limits: " + "; ".join(problems))
    return lines


# -- a peer's cubin ---------------------------------------------------------------------------------

def cubin_reports(*cubins: bytes, arch: str) -> dict[str, KernelReport]:
    """Every kernel of cubins fagen did not build (a peer's, e.g. FlashAttention-3's): its main
    loop (the loop with the most tensor-core work of its own), one steady-state iteration, and
    that iteration's HMMA-equivalents (no geometry: `non_tensor_per_tensor_op`)."""
    from .listing import disassemble

    return {name: analyse_foreign(name, instructions, arch)
            for name, instructions in parse_listing(disassemble(*cubins)).items()}


def analyse_foreign(name: str, instructions: list[Instruction], arch: str) -> KernelReport:
    """A kernel fagen did not build, without a geometry; a loop the steady-state walk cannot
    read is said in the report (`problem`), not raised."""
    try:
        return analyse_function(name, instructions, arch, None)
    except ValueError as exc:
        return KernelReport(name, arch, Counter(), 0.0, None, None, problem=str(exc))


def readable_names(names) -> dict[str, str]:
    """Mangled kernel names demangled by c++filt where the machine has it, else as they are."""
    import shutil
    import subprocess

    names = list(names)
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    result = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = result.stdout.splitlines()
    return dict(zip(names, lines)) if result.returncode == 0 and len(lines) == len(names) else {n: n for n in names}


def format_cubin_reports(reports: dict[str, KernelReport], width: int = 100) -> str:
    lines = [f"{'#':>3} {'loop':>7} {'instr':>6} {'tensor':>6} {'HMMA-eq':>8} {'non-tensor/HMMA-eq':>18}  kernel"]
    names = readable_names(reports)
    for index, (name, r) in enumerate(reports.items()):
        shown = names[name] if len(names[name]) <= width else names[name][:width - 3] + "..."
        if r.loop_address is None:
            lines.append(f"{index:>3} {'-':>7} {r.problem or '(no tensor-core loop)':>41}  {shown}")
            continue
        tensor = sum(r.counts.get(c, 0) for c in TENSOR_CLASSES)
        per = r.non_tensor_per_tensor_op
        lines.append(f"{index:>3} {r.loop_address:#7x} {r.instructions:>6} {tensor:>6} {r.tensor_ops:>8g} "
                     f"{per if per is None else f'{per:.2f}':>18}  {shown}")
        lines.extend(format_roles(r))
    return "\n".join(lines)
