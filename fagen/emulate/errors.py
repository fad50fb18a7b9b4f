"""The one exception the emulator raises."""


class EmulationError(RuntimeError):
    """A kernel fault found by the emulator (a barrier not reached by every
    thread, a warp-collective op called by part of a warp, an out-of-bounds
    access in a checked build, a failed assert, ...), a build failure, or a
    launch the emulator refuses (bad arguments, grid or block). The message
    names the kernel, the block and the thread."""
