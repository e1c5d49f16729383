"""Two nodes in two network namespaces joined by a veth pair: the multi-host path.

Each node runs ``node_proc.py`` under ``ip netns exec`` with UCX on tcp over its own veth
and its control plane bound to its own address, from a private /30 that exists only
inside this test's namespaces. Needs root and iproute2 (``ip``); skipped otherwise. The
namespaces (and with them the veth pair) are deleted in a ``finally``, also on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import pytest
import trio

from .helpers import NIXL_ONLY
from .node_proc import UCX_TCP, Children, block_crc

pytestmark = [pytest.mark.netns, *NIXL_ONLY]

BLOCK = 64 * 1024
SUBNET = ("10.213.7.1", "10.213.7.2")  # a /30 that lives only inside the test's namespaces


@attrs.frozen
class Side:
    namespace: str
    device: str
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespace)

    @property
    def env(self) -> dict[str, str]:
        return {"UCX_TLS": UCX_TCP, "UCX_NET_DEVICES": self.device}


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    done = _ip(*args)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"


def _wait_until_up(side: Side) -> None:
    """A veth end is usable (UCX lists it) only once its carrier is up, which lags the
    `link set up` by a moment; starting a node before that fails with "no such device"."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        done = _ip("-n", side.namespace, "-o", "link", "show", "dev", side.device)
        if "state UP" in done.stdout and "LOWER_UP" in done.stdout:
            return
        time.sleep(0.05)
    pytest.fail(f"{side.device} in {side.namespace} never came up: {done.stdout.strip()}")


@pytest.fixture
def veth_pair() -> Iterator[tuple[Side, Side]]:
    """Two namespaces, a veth pair between them with one /30 address each, links up."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2 (`ip`): apt-get install -y iproute2")
    tag = f"{os.getpid()}"
    a = Side(f"p2pkv-{tag}-a", f"pkv{tag}a", SUBNET[0])
    b = Side(f"p2pkv-{tag}-b", f"pkv{tag}b", SUBNET[1])
    created: list[str] = []
    try:
        for side in (a, b):
            done = _ip("netns", "add", side.namespace)
            if done.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {done.stderr.strip()}")
            created.append(side.namespace)
        veth = _ip(
            "link", "add", a.device, "netns", a.namespace, "type", "veth",
            "peer", "name", b.device, "netns", b.namespace,
        )  # fmt: skip
        if veth.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {veth.stderr.strip()}")
        for side in (a, b):
            _must("-n", side.namespace, "addr", "add", f"{side.address}/30", "dev", side.device)
            _must("-n", side.namespace, "link", "set", side.device, "up")
            _must("-n", side.namespace, "link", "set", "lo", "up")
        for side in (a, b):
            _wait_until_up(side)
        yield a, b
    finally:
        for namespace in created:
            _ip("netns", "del", namespace)  # takes the veth pair with it


@pytest.fixture
async def children(tmp_path: Path) -> AsyncIterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        await kids.aclose()


async def test_fetch_across_two_network_namespaces_is_byte_exact(
    veth_pair: tuple[Side, Side], children: Children
) -> None:
    a, b = veth_pair
    seed, count = 51, 128
    with trio.fail_after(90):
        src = await children.start(
            "ns-src",
            num_blocks=count,
            block_len=BLOCK,
            seed=seed,
            count=count,
            host=a.address,
            env=a.env,
            prefix=a.prefix,
        )
        dst = await children.start(
            "ns-dst",
            num_blocks=256,
            block_len=BLOCK,
            host=b.address,
            env=b.env,
            prefix=b.prefix,
        )
        assert src.address[0] == a.address and dst.address[0] == b.address
        await dst.call("scatter", count=96)  # 48 holes: scattered destination slots
        assert (await dst.call("connect", address=list(src.address)))["peer"] == "ns-src"
        got = await dst.call("fetch", peer="ns-src", seed=seed, start=0, count=count, shuffle=True)
        assert got["failed"] == {} and got["loaded"] == count
        assert got["mismatched"] == []
        assert got["crcs"] == [block_crc(seed, i, BLOCK) for i in got["indexes"]]
        assert got["slots"] != sorted(got["slots"])
        for side in (src, dst):
            stats = (await side.call("stats"))["stats"]
            assert stats["transport"]["live_agents"] == 1
            assert stats["transport"]["registered_regions"] == 1
            assert stats["transport"]["remote_peers"] == 1
        for side in (dst, src):
            closed = (await side.stop())["stats"]["transport"]
            assert (closed["live_agents"], closed["registered_regions"]) == (0, 0)
