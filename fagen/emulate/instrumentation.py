"""Racecheck and the counters, on the Python side: what a launch of an instrumented
module passes the runtime, what it gets back, and how a report names source lines.

    with fagen.emulate.collect_counters() as reports:   # every instrumented launch inside
        ...
    reports[0].kernel, reports[0].counters["mma"], reports[0].tensors["q"]["read_bytes"]

A module is instrumented when loaded with `racecheck=True` or `counters=True`, or
while FAGEN_EMULATE_RACECHECK is set (`fagen.kernels.launch` also loads instrumented
modules while counters are being collected). Instrumentation never changes a
result; it only sees every load and store.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import abi
from .errors import EmulationError, RaceError

_PC_MARKER = re.compile(r"\{\{pc:0x([0-9a-f]+)\}\}")


@dataclass
class LaunchReport:
    """The counters of one launch (see include/fagen_emulate/export.h, LaunchCounters)."""

    kernel: str
    grid: tuple
    block: tuple
    counters: dict[str, int]
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # by parameter name (or "arg<i>")

    @property
    def hbm_read_bytes(self) -> int:
        return sum(t["read_bytes"] + t["atomic_bytes"] for t in self.tensors.values())

    @property
    def hbm_write_bytes(self) -> int:
        return sum(t["written_bytes"] + t["atomic_bytes"] for t in self.tensors.values())

    @property
    def bank_conflicts(self) -> int:
        c = self.counters
        return c["shared_load_conflicts"] + c["shared_store_conflicts"] + c["ldmatrix_conflicts"]

    @property
    def sectors_per_request(self) -> float:
        c = self.counters
        requests = c["global_load_requests"] + c["global_store_requests"]
        return (c["global_load_sectors"] + c["global_store_sectors"]) / requests if requests else 0.0


_collectors: list[list[LaunchReport]] = []
_collectors_lock = threading.Lock()


@contextlib.contextmanager
def collect_counters():
    """Collect a LaunchReport for every instrumented launch made inside the block."""
    reports: list[LaunchReport] = []
    with _collectors_lock:
        _collectors.append(reports)
    try:
        yield reports
    finally:
        with _collectors_lock:
            _collectors.remove(reports)


def collecting() -> bool:
    return bool(_collectors)


def record(report: LaunchReport) -> None:
    with _collectors_lock:
        for reports in _collectors:
            reports.append(report)


def tensor_ranges(parameters, args) -> tuple[object, list[tuple[str, int]]]:
    """A ctypes array of TensorRange for the tensor arguments (one per storage: views of one
    storage share it), and (name, index) of each range for the report."""
    ranges, seen = [], {}
    for parameter, arg in zip(parameters, args):
        if not isinstance(arg, torch.Tensor):
            continue
        storage = arg.untyped_storage()
        begin = storage.data_ptr()
        if begin in seen or storage.nbytes() == 0:
            continue
        seen[begin] = len(ranges)
        ranges.append((parameter, begin, storage.nbytes(), arg.element_size()))
    array = (abi.TensorRange * max(1, len(ranges)))()
    names = []
    for i, (parameter, begin, nbytes, element_bytes) in enumerate(ranges):
        array[i].begin, array[i].bytes = begin, nbytes
        array[i].argument, array[i].element_bytes = parameter.index, element_bytes
        array[i].flags = 0 if parameter.is_const else abi.TENSOR_WRITABLE
        names.append(parameter.index)
    return (array if ranges else array[:0]), names


def report_of(kernel: str, grid, block, counters, tensors, indices, names) -> LaunchReport:
    """The LaunchReport of a finished launch; `names` maps parameter index to a name."""
    per_tensor = {}
    for i, index in enumerate(indices):
        name = names.get(index, f"arg{index}")
        per_tensor[name] = {key: int(getattr(tensors[i], key)) for key in abi.TENSOR_COUNTERS}
    return LaunchReport(kernel=kernel, grid=tuple(grid), block=tuple(block),
                        counters={key: int(getattr(counters, key)) for key in abi.LAUNCH_COUNTERS},
                        tensors=per_tensor)


# -- source lines in reports ------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _lines_of(library: str, offset: int) -> list[tuple[str, int]]:
    """(file, line) of the instruction before return address `offset` in `library`,
    innermost inlined frame first."""
    tool = shutil.which("addr2line")
    if tool is None:
        return []
    result = subprocess.run([tool, "-e", library, "-i", hex(max(0, offset - 1))], capture_output=True, text=True,
                            check=False)
    lines = []
    for text in result.stdout.splitlines():
        path, _, line = text.strip().rpartition(":")
        line = line.split(" ")[0]
        if path and line.isdigit():
            lines.append((path, int(line)))
    return lines


def _source_line(source: Path, line: int) -> str:
    try:
        return source.read_text().splitlines()[line - 1].strip()
    except (OSError, IndexError):
        return ""


def describe_pc(library: Path, source: Path, offset: int) -> str:
    """`<source>.cu:LINE (`code`)`: the generated source's line, or the innermost one known."""
    frames = _lines_of(str(library), offset)
    for path, line in frames:
        if Path(path).name == source.name:
            code = _source_line(source, line)
            return f"{source.name}:{line}" + (f" (`{code[:100]}`)" if code else "")
    if frames:
        path, line = frames[0]
        return f"{Path(path).name}:{line}"
    return f"{library.name}+{offset:#x}"


def launch_error(message: str, library: Path, source: Path) -> EmulationError:
    """The exception for a failed launch: a RaceError for racecheck's reports, with source lines."""
    if "racecheck:" not in message:
        return EmulationError(message)
    text = _PC_MARKER.sub(lambda m: describe_pc(library, source, int(m.group(1), 16)), message)
    return RaceError(text)
