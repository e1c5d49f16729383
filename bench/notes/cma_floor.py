"""The kernel copy floor under both vLLM tiers: process_vm_writev between two processes.

    .venv/bin/python bench/notes/cma_floor.py

UCX's cma transport moves host memory between processes on one machine with one
process_vm_writev per descriptor; this times exactly that, 2 MiB at a time over 1 GiB,
between /dev/shm mappings (vLLM's primary tier) and between anonymous mappings, against a
plain memcpy of the same size in one process.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

import numpy as np

N = 1 << 30
BLOCK = 2 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_writev.restype = ctypes.c_ssize_t


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def region(shm: bool) -> np.ndarray:
    if shm:
        path = f"/dev/shm/cma-floor-{os.getpid()}-{time.monotonic_ns()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, N)
        m = mmap.mmap(fd, N)
        os.close(fd)
        os.unlink(path)
    else:
        m = mmap.mmap(-1, N)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1  # touched, like a primary tier that has been in use
    return a


def one(shm: bool) -> float:
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        dst = region(shm)
        os.write(w, dst.ctypes.data.to_bytes(8, "little"))
        os.read(r2, 1)
        os._exit(0)
    addr = int.from_bytes(os.read(r, 8), "little")
    src = region(shm)
    t = time.perf_counter()
    for off in range(0, N, BLOCK):
        local = IoVec(src.ctypes.data + off, BLOCK)
        remote = IoVec(addr + off, BLOCK)
        assert libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    dt = time.perf_counter() - t
    os.write(w2, b"x")
    os.waitpid(pid, 0)
    return N / dt / 1e9


def main() -> None:
    argparse.ArgumentParser(description=__doc__.partition("\n")[0]).parse_args()  # --help
    a = np.ones(N, np.uint8)
    b = np.empty(N, np.uint8)
    b.fill(0)  # touched: page faults are not what this measures
    t = time.perf_counter()
    np.copyto(b, a)
    print(f"memcpy, one process:           {N / (time.perf_counter() - t) / 1e9:5.2f} GB/s")
    del a, b
    for _ in range(2):
        print(f"process_vm_writev, /dev/shm:   {one(True):5.2f} GB/s")
        print(f"process_vm_writev, anonymous:  {one(False):5.2f} GB/s")


if __name__ == "__main__":
    main()
