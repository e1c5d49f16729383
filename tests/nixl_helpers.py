"""A NIXL write target in a child process, for the two-process tests.

Run as a script by ``tests/test_nixl_transport.py`` (never imported by it, so it works
whether or not ``tests`` is a package): ``python nixl_helpers.py FD NAME NUM_BLOCKS
BLOCK_LEN``. It talks over the inherited socket ``FD`` with length-prefixed pickles (stdout
is no use: UCX logs there). It sends ``{"metadata", "layout", "pid"}`` first, then answers:

* ``("progress", bool)``: drive (or stop driving) ``transport.progress()``; a write target
  must make progress or the initiator's write stays ``PROC``;
* ``("digest", [slots])``: the crc32 of each slot;
* ``("stop",)``: close the transport and exit. EOF on the socket does the same.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

_HEADER = struct.Struct("!I")


def send_msg(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    """The next message, or None at EOF."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = _recv_exactly(sock, size)
    return None if body is None else pickle.loads(body)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def block_crcs(region: np.ndarray[Any, Any], block_len: int, slots: list[int]) -> list[int]:
    return [zlib.crc32(region[s * block_len : (s + 1) * block_len].data) for s in slots]


def target_main(fd: int, name: str, num_blocks: int, block_len: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from p2pkv.transport.base import RegionLayout
    from p2pkv.transport.nixl import NixlTransport

    sock = socket.socket(fileno=fd)
    region = np.zeros(num_blocks * block_len, dtype=np.uint8)
    layout = RegionLayout(region.ctypes.data, num_blocks, block_len)
    transport = NixlTransport.create(agent_name=name, region=region, layout=layout)
    try:
        hello = {"metadata": transport.metadata(), "layout": layout, "pid": os.getpid()}
        send_msg(sock, hello)
        progressing = True
        while True:
            ready, _, _ = select.select([sock], [], [], 0.001 if progressing else 0.05)
            if ready:
                msg = recv_msg(sock)
                if msg is None or msg[0] == "stop":
                    break
                if msg[0] == "progress":
                    progressing = bool(msg[1])
                    send_msg(sock, "ok")
                elif msg[0] == "digest":
                    send_msg(sock, block_crcs(region, block_len, list(msg[1])))
                else:
                    send_msg(sock, f"unknown command {msg[0]!r}")
            if progressing:
                transport.progress()
    finally:
        transport.close()
        sock.close()


if __name__ == "__main__":
    target_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
