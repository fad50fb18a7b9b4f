"""The checked helper process (see checked.py): runs launches of sanitizer builds.

Run as a script, with libasan preloaded: `python checked_runner.py REPLY_FD`.
It imports neither torch nor the fagen package (only abi.py, next to it), so
it starts fast. Reads request paths from stdin, one per line; for each, copies
the argument storages into exactly-sized malloc buffers, launches, and writes
the path of a pickled result to the reply pipe. A sanitizer report ends the
process instead; its stderr is the parent's error message.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pickle
import sys
from pathlib import Path


def load_abi():
    spec = importlib.util.spec_from_file_location("fagen_emulate_abi", Path(__file__).with_name("abi.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


abi = load_abi()
MAP_ADDRESS = abi.TENSOR_MAP_ADDRESS_OFFSET
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def run(request: dict, libraries: dict) -> dict:
    path, name = request["library"], request["name"]
    if path not in libraries:
        libraries[path] = abi.Library(path)
    found = libraries[path].kernel(name)
    if found is None:
        known = ", ".join(libraries[path].kernel_names()) or "none"
        return {"ok": False, "error": f"no kernel {name!r} in {Path(path).name} (kernels with FAGEN_EXPORT: {known})"}
    launcher, parameters = found
    args = request["args"]
    if len(args) != len(parameters):
        return {"ok": False, "error": f"{name} takes {len(parameters)} arguments "
                                      f"({', '.join(p.c_type for p in parameters)}), got {len(args)}"}
    # Exactly-sized buffers: ASan's redzone starts right after the last byte.
    buffers = [libc.malloc(len(data)) if data else None for data in request["storages"]]
    try:
        for buffer, data in zip(buffers, request["storages"]):
            if buffer:
                ctypes.memmove(buffer, data, len(data))
        values = []
        for parameter, arg in zip(parameters, args):
            if arg[0] == "null":
                values.append(parameter.pointer(None, None, name))
            elif arg[0] == "tensor":
                _, storage, offset, code = arg
                base = buffers[storage]
                values.append(parameter.pointer(code, base + offset if base else None, name))
            elif arg[0] == "tensor_map":   # re-pointed at this process's copy of its tensor
                _, data, storage, offset = arg
                address = (buffers[storage] + offset).to_bytes(8, "little")
                values.append(parameter.scalar(data[:MAP_ADDRESS] + address + data[MAP_ADDRESS + 8:], name))
            else:
                values.append(parameter.scalar(arg[1], name))
        error = abi.launch(launcher, request["grid"], request["block"], request["shared_mem"],
                           request["os_threads"], request["schedule"], values,
                           block_order=request["block_order"], seed=request["seed"],
                           block_interleave=request["block_interleave"])
        if error is not None:
            return {"ok": False, "error": error}
        written = [p.index for p in parameters if (p.is_pointer and not p.is_const and args[p.index][0] == "tensor")
                   or args[p.index][0] == "tensor_map"]
        storages = [ctypes.string_at(b, len(d)) if b else b"" for b, d in zip(buffers, request["storages"])]
        return {"ok": True, "written": written, "storages": storages}
    except abi.ArgumentError as error:
        return {"ok": False, "error": str(error)}
    finally:
        for buffer in buffers:
            if buffer:
                libc.free(buffer)


def serve(reply_fd: int) -> None:
    libraries: dict = {}
    with os.fdopen(reply_fd, "w") as replies:
        for line in sys.stdin:
            path = line.strip()
            if not path:
                continue
            request = pickle.loads(Path(path).read_bytes())
            result = run(request, libraries)
            out = path + ".result"
            Path(out).write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            replies.write(out + "\n")
            replies.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
