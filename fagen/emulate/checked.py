"""Checked launches: the kernel built with AddressSanitizer + UBSan, run in a helper process.

An ASan-instrumented library can only be loaded into a process whose first
library is libasan, so checked launches run in one long-lived helper process
(fagen/emulate/checked_runner.py, without torch so that it starts in well
under a second) started with libasan in LD_PRELOAD. Each tensor argument's
storage is copied into a buffer malloc'ed to its exact size there, so a
kernel reading or writing past the end of a tensor's storage, past the
launch's dynamic shared memory (the runtime poisons the rest of the buffer),
or past a per-thread array is stopped at the faulting access, as is a signed
overflow or out-of-range array index (UBSan). The report, with the block and
thread that faulted, becomes an EmulationError here; the helper is restarted
for the next launch.

Tensors that share a storage (views) share it in the helper too. After a
successful launch, the tensors behind non-const pointer parameters are copied
back into the caller's tensors.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from . import abi
from .build import BuiltModule, compiler
from .errors import EmulationError
from .launch_args import block_interleave, block_order, dim3, dtype_code, os_threads, schedule, schedule_seed

CONTEXT_MARKER = "fagen-emulate-fault-context:"
ASAN_OPTIONS = ("detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:detect_stack_use_after_return=0:"
                "detect_odr_violation=0:symbolize=1:print_summary=1")
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1:exitcode=87"
REPORT_LINES = 40


def libasan_path() -> str:
    result = subprocess.run([compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True,
                            check=False)
    path = result.stdout.strip()
    if result.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        raise EmulationError("checked builds need AddressSanitizer's runtime (libasan) for the host "
                             "compiler; it was not found (on Debian/Ubuntu it comes with g++ as libasan8)")
    return os.path.realpath(path)


def summarize_report(stderr: str) -> str:
    """The sanitizer report's essential lines: what, where, and which thread of which block."""
    lines = stderr.splitlines()
    context = [line.split(CONTEXT_MARKER, 1)[1].strip() for line in lines if CONTEXT_MARKER in line]
    start = next((i for i, line in enumerate(lines)
                  if "ERROR: AddressSanitizer" in line or "runtime error:" in line or "ERROR: " in line), None)
    excerpt = lines[start:start + REPORT_LINES] if start is not None else lines[-REPORT_LINES:]
    shadow = next((i for i, line in enumerate(excerpt) if line.startswith("Shadow bytes around")), None)
    if shadow is not None:
        excerpt = excerpt[:shadow]
    summary = next((line for line in lines if line.startswith("SUMMARY:")), None)
    head = summary or (excerpt[0] if excerpt else "the checked helper process died without a report")
    parts = [head.strip()]
    if context:
        parts.append("while running " + context[-1])
    parts.append("\n".join(excerpt))
    return "\n".join(parts)


class CheckedRunner:
    """The helper process: started on first use, restarted after a fault kills it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._replies = None
        self._stderr = None
        self._workdir = Path(tempfile.mkdtemp(prefix="fagen-checked-"))
        self._counter = itertools.count()
        atexit.register(self.close)

    def _start(self) -> None:
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, [libasan_path(), env.get("LD_PRELOAD")]))
        env["ASAN_OPTIONS"] = ASAN_OPTIONS
        env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
        read_fd, write_fd = os.pipe()
        self._stderr = open(self._workdir / f"stderr-{next(self._counter)}.txt", "w+")
        try:
            self._process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("checked_runner.py")), str(write_fd)],
                stdin=subprocess.PIPE, stderr=self._stderr, pass_fds=(write_fd,), env=env, text=True)
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")

    def _died(self) -> str:
        self._process.wait()
        try:
            self._process.stdin.close()
        except OSError:  # the pipe's reader is gone
            pass
        self._stderr.flush()
        self._stderr.seek(0)
        report = self._stderr.read()
        self._stderr.close()
        self._replies.close()
        self._process = None
        return report

    def run(self, request: dict) -> dict:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            path = self._workdir / f"request-{next(self._counter)}.pickle"
            path.write_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            try:
                self._process.stdin.write(f"{path}\n")
                self._process.stdin.flush()
                reply = self._replies.readline().strip()
            except (BrokenPipeError, OSError):
                reply = ""
            if not reply:
                report = self._died()
                raise EmulationError(f"{request['name']}: checked run failed: {summarize_report(report)}")
            try:
                return pickle.loads(Path(reply).read_bytes())
            finally:
                os.unlink(path)
                os.unlink(reply)

    def close(self) -> None:
        if self._process is not None:
            try:
                self._process.stdin.close()
                self._process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
            self._process = None
        for handle in (self._replies, self._stderr):
            if handle is not None and not handle.closed:
                handle.close()
        shutil.rmtree(self._workdir, ignore_errors=True)


_runner: CheckedRunner | None = None
_runner_lock = threading.Lock()


def runner() -> CheckedRunner:
    global _runner
    with _runner_lock:
        if _runner is None:
            _runner = CheckedRunner()
        return _runner


def storage_bytes(tensor: torch.Tensor) -> bytes:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy().tobytes()


def describe_arguments(args: tuple) -> tuple[list, list[bytes]]:
    """Arguments as the helper takes them: tensors as (storage index, byte offset, element code);
    an emulated tensor map made from a tensor (`MappedBytes`) as its bytes, the storage it points
    into and the offset there (the helper re-points the map at its copy)."""
    described, storages, index = [], [], {}

    def storage_of(tensor: torch.Tensor) -> int:
        if tensor.device.type != "cpu":
            raise EmulationError(f"the emulator runs on CPU tensors, got one on {tensor.device}")
        key = tensor.untyped_storage().data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(storage_bytes(tensor))
        return index[key]

    for arg in args:
        if arg is None:
            described.append(("null",))
        elif isinstance(arg, torch.Tensor):
            described.append(("tensor", storage_of(arg), arg.storage_offset() * arg.element_size(),
                              dtype_code(arg.dtype)))
        elif isinstance(arg, bytes) and isinstance(getattr(arg, "tensor", None), torch.Tensor):   # MappedBytes
            at = abi.TENSOR_MAP_ADDRESS_OFFSET
            address = int.from_bytes(arg[at:at + 8], "little")
            offset = address - arg.tensor.untyped_storage().data_ptr()
            described.append(("tensor_map", bytes(arg), storage_of(arg.tensor), offset))
        else:
            described.append(("scalar", arg))
    return described, storages


class CheckedFunction:
    """Same call as EmulatedFunction; the launch happens in the checked helper."""

    def __init__(self, module: "CheckedModule", name: str):
        self.module = module
        self.name = name

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        args = tuple(args)
        described, storages = describe_arguments(args)
        request = {
            "library": str(self.module.library_path), "name": self.name,
            "grid": dim3(grid, "grid"), "block": dim3(block, "block"), "shared_mem": int(shared_mem),
            "os_threads": os_threads(), "schedule": schedule(), "block_order": block_order(),
            "seed": schedule_seed(), "block_interleave": block_interleave(),
            "args": described, "storages": storages,
        }
        result = runner().run(request)
        if not result["ok"]:
            raise EmulationError(result["error"])
        for i in result["written"]:
            arg = args[i].tensor if described[i][0] == "tensor_map" else args[i]   # a TMA store writes it
            if arg.numel() == 0:   # a writable argument this launch does not use: nothing came back
                continue
            storage = described[i][2 if described[i][0] == "tensor_map" else 1]
            data = torch.frombuffer(bytearray(result["storages"][storage]), dtype=torch.uint8)
            arg.copy_(data.view(arg.dtype).as_strided(arg.size(), arg.stride(), arg.storage_offset()))


class CheckedModule:
    """A module built with sanitizers; its functions run in the helper process."""

    def __init__(self, built: BuiltModule):
        self.built = built
        self.library_path = built.library
        self.source_path = built.source

    def get_function(self, name: str) -> CheckedFunction:
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise EmulationError(f"{name!r} is not a kernel name")
        return CheckedFunction(self, name)
