"""The one exception the emulator raises."""


class EmulationError(RuntimeError):
    """A kernel fault found by the emulator (a barrier not reached by every
    thread, a warp-collective op called by part of a warp, an out-of-bounds
    access in a checked build, a failed assert, ...), a build failure, or a
    launch the emulator refuses (bad arguments, grid or block). The message
    names the kernel, the block and the thread."""


class RaceError(EmulationError):
    """A hazard racecheck found (FAGEN_EMULATE_RACECHECK=1, or load_module(..., racecheck=True)):
    two threads access one byte of shared memory, at least one writing, with no barrier (or,
    within a warp, no __syncwarp) ordering them; a cp.async destination touched before its
    wait; or two blocks storing to one element of a tensor without an atomic. The message
    names the hazard, the byte, both threads and both source lines."""
