"""Mutual TLS of the control connection, with certificates made here for each test.

Real TCP on loopback and the in-process data plane. The PKI (:class:`PKI`) issues
certificates that name a peer id as the SAN URI ``p2pkv://<peer id>``; a second CA plays
the stranger. The deadline test runs on the autojump clock with a FAKE inline offload
(:class:`~tests.helpers.VirtualOffload`), so no real thread runs under virtual time.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from p2pkv import (
    HandshakeRejected,
    Node,
    NodeConfig,
    P2PKVError,
    P2PKVTimeout,
    PeerUnavailable,
    open_node,
    start_node,
)
from p2pkv.cli import build_parser
from p2pkv.cli.settings import fetch_settings, serve_settings
from p2pkv.tls import cert_file_peer_id, cert_peer_ids, peer_uri

from .helpers import FaultFactory, RawPeer, VirtualOffload, config, fill
from .test_host_pins import lookups_behind_a_stalled_host_are_answered_within_one_host_wait

BOUND = 20  # seconds (Trio clock) around every test's I/O


class CA:
    """A certificate authority that writes PEM files for peer certificates."""

    def __init__(self, name: str, directory: Path) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_file = directory / f"{name}-ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        names: list[str],
        *,
        file_stem: str,
        uris: list[str] | None = None,
        dns: list[str] | None = None,
    ) -> tuple[Path, Path]:
        """A certificate whose SAN URIs name ``names`` (peer ids), and its key; ``uris``:
        these SAN URIs instead, spelled as given; ``dns``: SAN DNS names besides."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, file_stem)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if uris is None:
            uris = [peer_uri(n) for n in names]
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns or []]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file = self.dir / f"{file_stem}.pem"
        key_file = self.dir / f"{file_stem}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file, key_file


class PKI:
    """The fleet's CA plus a stranger's CA; ``tls(...)`` gives NodeConfig TLS settings."""

    def __init__(self, directory: Path) -> None:
        self.ca = CA("fleet", directory)
        self.stranger = CA("stranger", directory)
        self._n = 0

    def tls(
        self,
        *names: str,
        issuer: CA | None = None,
        trust: CA | None = None,
        uris: list[str] | None = None,
        dns: list[str] | None = None,
    ) -> dict[str, Any]:
        self._n += 1
        cert, key = (issuer or self.ca).issue(
            list(names), file_stem=f"peer{self._n}", uris=uris, dns=dns
        )
        return {"tls_cert": cert, "tls_key": key, "tls_ca": (trust or self.ca).ca_file}


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    return PKI(tmp_path)


@asynccontextmanager
async def recording_proxy(
    target: tuple[str, int], mute: dict[str, bool] | None = None
) -> AsyncIterator[tuple[tuple[str, int], bytearray]]:
    """A TCP relay to ``target`` that records every byte that crosses it (both ways).
    With ``mute``, once ``mute["on"]`` is set the bytes from the dialing side stop reaching
    ``target`` (read and dropped) while the other direction flows: to ``target``, a peer
    that went silent."""
    seen = bytearray()

    async def relay(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(*target)
        async with client, server, trio.open_nursery() as nursery:

            async def pipe(src: trio.SocketStream, dst: trio.SocketStream, muted: bool) -> None:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await src.receive_some(1 << 16):
                        seen.extend(data)
                        if not (muted and mute is not None and mute["on"]):
                            await dst.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(pipe, client, server, True)
            nursery.start_soon(pipe, server, client, False)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, relay, listeners)
        yield ("127.0.0.1", port), seen
        nursery.cancel_scope.cancel()


# --- the happy path ------------------------------------------------------------------------


@pytest.mark.parametrize("use_tls", [True, False], ids=["tls", "plain_control"])
async def test_fetch_over_mutual_tls_is_byte_exact_and_unreadable_on_the_wire(
    pki: PKI, use_tls: bool
) -> None:
    a_tls = pki.tls("a") if use_tls else {}
    b_tls = pki.tls("b") if use_tls else {}
    with trio.fail_after(BOUND):
        async with open_node(config("a", **a_tls)) as a, open_node(config("b", **b_tls)) as b:
            keys = fill(a.store, 8, 4096)
            async with recording_proxy(a.address) as (via, wire):
                peer = await b.connect(via)
                assert peer.peer_id == "a"
                result = await b.fetch(peer, keys)
                assert sorted(result.loaded) == sorted(keys) and not result.failed
                for k in keys:
                    got, want = b.store.get(k), a.store.get(k)
                    assert got is not None and want is not None
                    assert bytes(got) == bytes(want)
                # The keys went out in the lookup and the fetch: readable only without TLS.
                readable = [k for k in keys if k in wire]
                assert readable == ([] if use_tls else keys)


def test_tls_settings_come_all_three_or_not_at_all(pki: PKI) -> None:
    files = pki.tls("a")
    for missing in files:
        partial = {k: v for k, v in files.items() if k != missing}
        with pytest.raises(P2PKVError, match="tls_cert, tls_key and tls_ca together"):
            NodeConfig(peer_id="a", **partial)
    assert NodeConfig(peer_id="a", **files).tls_ca == os.fspath(files["tls_ca"])


async def test_unreadable_tls_files_fail_the_node_start_with_a_typed_error(
    pki: PKI, tmp_path: Path
) -> None:
    files = pki.tls("a") | {"tls_key": tmp_path / "missing.key"}
    factory = FaultFactory()
    with trio.fail_after(BOUND), pytest.raises(P2PKVError, match="cannot load the TLS"):
        async with open_node(config("a", **files), transport=factory):
            pass  # pragma: no cover
    assert factory.transport._closed  # the data plane built before the failure is closed


def test_a_certificate_names_its_peer_id_as_a_p2pkv_uri() -> None:
    cert = {"subjectAltName": (("DNS", "a"), ("URI", peer_uri("gpu 7/ü")), ("URI", "https://x"))}
    assert peer_uri("gpu 7/ü") == "p2pkv://gpu%207%2F%C3%BC"
    assert cert_peer_ids(cert) == ["gpu 7/ü"]


# Other spellings that percent-decoding alone read as an id: "b" encoded, bytes that are
# not UTF-8 (two of them decoded to the same U+FFFD), a raw path and a raw query.
NOT_CANONICAL = {
    "p2pkv://%62": "b",
    "p2pkv://%FF": "\ufffd",
    "p2pkv://%FE": "\ufffd",
    "p2pkv://b/x": "b/x",
    "p2pkv://b?x": "b?x",
}


def test_only_the_canonical_spelling_of_a_uri_names_a_peer(pki: PKI) -> None:
    for uri in NOT_CANONICAL:
        assert cert_peer_ids({"subjectAltName": (("URI", uri),)}) == [None]
        files = pki.tls(uris=[uri])
        with pytest.raises(P2PKVError, match="names no peer"):
            cert_file_peer_id(os.fspath(files["tls_cert"]))


@pytest.mark.parametrize(("uri", "claimed"), list(NOT_CANONICAL.items()))
async def test_a_certificate_naming_an_id_in_another_spelling_is_refused(
    pki: PKI, uri: str, claimed: str
) -> None:
    """A CA (and its name constraints) judge the literal string: a certificate issued
    for "p2pkv://%62" passed for peer "b" (OpenSSL verified one from a CA whose name
    constraints exclude "p2pkv://b"), and the holder could take b's place."""
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config(claimed, **pki.tls(uris=[uri]))) as impostor,
        ):
            with pytest.raises(HandshakeRejected, match="not the canonical spelling"):
                await impostor.connect(a.address)
            assert a.peers() == []


async def test_a_p2pkv_name_outside_a_uri_san_names_no_peer(pki: PKI) -> None:
    """Only SAN URIs name a peer; CN and DNS names are ignored. A CA whose name
    constraints cover URIs only may issue any DNS name, "p2pkv://b" among them: its
    holder is not b, and no peer id defaults from it."""
    sans = (("DNS", "p2pkv://b"), ("email", "p2pkv://b"), ("URI", peer_uri("a")))
    assert cert_peer_ids({"subjectAltName": sans}) == ["a"]
    files = pki.tls(dns=["p2pkv://b"])
    with pytest.raises(P2PKVError, match="names 0 peer ids"):
        cert_file_peer_id(os.fspath(files["tls_cert"]))
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("b", **files)) as impostor,
        ):
            with pytest.raises(HandshakeRejected, match="certificate names no p2pkv:// URI"):
                await impostor.connect(a.address)
            assert a.peers() == []


async def test_tls_older_than_1_3_is_refused_both_ways(pki: PKI) -> None:
    """TLS 1.3 at least, as accepted and as dialed: a peer holding a good fleet
    certificate but speaking TLS 1.2 at most gets no connection either way."""

    def tls12(purpose: int, files: dict[str, Any]) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(files["tls_cert"], files["tls_key"])
        ctx.load_verify_locations(cafile=files["tls_ca"])
        return ctx

    old = pki.tls("old")
    handshakes: list[str] = []

    async def old_server(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.do_handshake()
            handshakes.append("done")
        except trio.BrokenResourceError:
            handshakes.append("refused")
        await stream.aclose()

    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("b", **pki.tls("b"))) as b,
            trio.open_nursery() as nursery,
        ):
            client = trio.SSLStream(
                await trio.open_tcp_stream(*a.address), tls12(ssl.PROTOCOL_TLS_CLIENT, old)
            )
            with pytest.raises(trio.BrokenResourceError):
                await client.do_handshake()
            await client.aclose()
            assert a.peers() == []

            listeners = await trio.open_ssl_over_tcp_listeners(
                0, tls12(ssl.PROTOCOL_TLS_SERVER, old), host="127.0.0.1"
            )
            await nursery.start(trio.serve_listeners, old_server, listeners)
            plain = listeners[0].transport_listener
            assert isinstance(plain, trio.SocketListener)
            port = plain.socket.getsockname()[1]
            with pytest.raises(HandshakeRejected, match="TLS handshake failed"):
                await b.connect(("127.0.0.1", port))
            assert b.peers() == []
            nursery.cancel_scope.cancel()
    assert handshakes == ["refused"]


# --- refusals ------------------------------------------------------------------------------


async def _bare_tls_client(pki: PKI, address: tuple[str, int]) -> bool:
    """A TLS client that trusts the fleet CA but shows no certificate. True if the node
    closed the connection on it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=pki.ca.ca_file)
    stream = trio.SSLStream(await trio.open_tcp_stream(*address), ctx)
    async with stream:
        try:
            await stream.do_handshake()  # TLS 1.3: the client's side ends before the verdict
            while await stream.receive_some(1 << 16):
                pass
        except trio.BrokenResourceError:
            pass
        return True


@pytest.mark.parametrize(
    "intruder", ["no_certificate", "stranger_ca", "certificate_of_another_peer"]
)
async def test_refused_clients_leave_the_listener_serving_its_good_peer(
    pki: PKI, intruder: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv")
    factory = FaultFactory()
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a")), transport=factory) as a,
            open_node(config("b", **pki.tls("b"))) as b,
        ):
            keys = fill(a.store, 4, 4096)
            peer = await b.connect(a.address)
            if intruder == "no_certificate":
                assert await _bare_tls_client(pki, a.address)
                logged = "TLS handshake failed"
            elif intruder == "stranger_ca":
                async with open_node(
                    config("m", **pki.tls("m", issuer=pki.stranger, trust=pki.ca))
                ) as m:
                    with pytest.raises(P2PKVError):
                        await m.connect(a.address)
                logged = "certificate verify failed"
            else:
                # Holds a real fleet certificate, for "mallory", and says it is "b": were
                # the hello acted on, its new epoch would supersede b's live session.
                async with open_node(config("b", **pki.tls("mallory"))) as impostor:
                    with pytest.raises(HandshakeRejected) as info:
                        await impostor.connect(a.address)
                    assert info.value.remote
                    assert "certificate names 'mallory'" in info.value.reason
                logged = "certificate names 'mallory', but the hello says 'b'"
            assert logged in caplog.text
            assert factory.transport.adds == 1  # only the good peer was ever registered
            assert [p.peer_id for p in a.peers()] == ["b"]
            result = await b.fetch(peer, keys)
            assert sorted(result.loaded) == sorted(keys)
            async with open_node(config("c", **pki.tls("c"))) as c:
                late = await c.connect(a.address)
                assert sorted((await c.fetch(late, keys)).loaded) == sorted(keys)


async def test_a_dialer_whose_certificate_is_refused_is_told_what_the_close_means(
    pki: PKI,
) -> None:
    """Under TLS 1.3 a dialer's side of the handshake ends before the listener judges its
    certificate, and the listener's refusal reaches it as a bare close (no alert goes
    out). Its error said "connection lost: " and nothing more: a TLS stream's
    BrokenResourceError has no text of its own (its cause has). It now says what a
    close before the peer's first frame means, as the design does (review 2026-12-05)."""
    stranger = pki.tls("m", issuer=pki.stranger, trust=pki.ca)
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("m", **stranger)) as m,
        ):
            with pytest.raises(PeerUnavailable) as info:
                await m.connect(a.address)
            assert "connection lost: " in info.value.message
            assert not info.value.message.endswith(": ")
            assert "refuses our certificate" in info.value.message
            assert a.peers() == [] and m.peers() == []


async def test_the_dialer_checks_the_listeners_certificate_too(pki: PKI) -> None:
    factory = FaultFactory()
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("z"))) as a,
            open_node(config("b", **pki.tls("b")), transport=factory) as b,
        ):
            with pytest.raises(HandshakeRejected) as info:
                await b.connect(a.address)
            assert not info.value.remote
            assert "certificate names 'z', but the hello says 'a'" in info.value.reason
            assert factory.transport.adds == 0
            assert a.peers() == [] and b.peers() == []


async def test_a_certificate_naming_two_peers_is_refused(pki: PKI) -> None:
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("b", **pki.tls("b", "a"))) as b,
        ):
            with pytest.raises(HandshakeRejected, match="certificate names 'b', 'a'"):
                await b.connect(a.address)
            assert a.peers() == []


async def test_plain_peer_and_tls_node_refuse_each_other_with_a_clear_error(pki: PKI) -> None:
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("p")) as plain,
        ):
            with pytest.raises(HandshakeRejected) as info:
                await plain.connect(a.address)
            assert info.value.remote and "requires TLS" in info.value.reason
            with pytest.raises(HandshakeRejected, match="peer does not speak TLS"):
                await a.connect(plain.address)
            assert a.peers() == [] and plain.peers() == []


async def test_a_plain_peer_with_a_secret_and_a_tls_node_time_out_typed(
    pki: PKI, autojump_clock: trio.testing.MockClock
) -> None:
    """A guard for what the docs now say (review 2026-12-05): a plain dialer with a secret
    waits for the challenge and says nothing, and the TLS listener waits for a
    ClientHello, so no plaintext bye can tell it that TLS is required: both sides end at
    their handshake deadline with a P2PKVTimeout, and the listener serves on."""
    kw: dict[str, Any] = {"handshake_timeout": 3.0}
    with trio.fail_after(BOUND):
        async with (
            open_node(
                config("a", **kw, **pki.tls("a")),
                offload=VirtualOffload(),
                transport=FaultFactory(),
            ) as a,
            open_node(
                config("p", secret=b"k" * 32, **kw),
                offload=VirtualOffload(),
                transport=FaultFactory(),
            ) as plain,
            open_node(
                config("b", **pki.tls("b")), offload=VirtualOffload(), transport=FaultFactory()
            ) as b,
        ):
            with pytest.raises(P2PKVTimeout, match="handshake timed out"):
                await plain.connect(a.address)
            assert [p.peer_id for p in (await b.connect(a.address),)] == ["a"]
            assert [p.peer_id for p in a.peers()] == ["b"]


# --- deadlines -----------------------------------------------------------------------------


async def test_a_stalled_tls_handshake_is_dropped_at_the_deadline_while_others_connect(
    pki: PKI, autojump_clock: trio.testing.MockClock
) -> None:
    timeout = 5.0
    with trio.fail_after(BOUND):
        async with (
            open_node(
                config("a", handshake_timeout=timeout, **pki.tls("a")),
                offload=VirtualOffload(),
                transport=FaultFactory(),
            ) as a,
            open_node(
                config("b", **pki.tls("b")), offload=VirtualOffload(), transport=FaultFactory()
            ) as b,
        ):
            keys = fill(a.store, 2, 4096)
            stalled = await trio.open_tcp_stream(*a.address)
            t0 = trio.current_time()
            await stalled.send_all(bytes.fromhex("1603010200"))  # a ClientHello that stops
            peer = await b.connect(a.address)
            assert sorted((await b.fetch(peer, keys)).loaded) == sorted(keys)
            served_at = trio.current_time()
            with suppress(trio.BrokenResourceError):
                assert await stalled.receive_some(1 << 16) == b""
            dropped_at = trio.current_time()
            await stalled.aclose()
            assert served_at < t0 + timeout <= dropped_at < t0 + timeout + 1.0
            assert [p.peer_id for p in a.peers()] == ["b"]


async def test_a_dialed_listener_that_never_answers_tls_times_out_typed(
    pki: PKI, autojump_clock: trio.testing.MockClock
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(BOUND):
        async with open_node(
            config("b", handshake_timeout=3.0, **pki.tls("b")),
            offload=VirtualOffload(),
            transport=FaultFactory(),
        ) as b:
            t0 = trio.current_time()
            with pytest.raises(P2PKVTimeout, match="TLS handshake timed out"):
                await b.connect(("127.0.0.1", port))
            assert trio.current_time() - t0 == pytest.approx(3.0, abs=0.5)
    await listeners[0].aclose()


@pytest.mark.parametrize("use_tls", [True, False], ids=["tls", "plain"])
def test_a_blocking_connects_default_timeout_counts_the_tls_handshake(
    pki: PKI, use_tls: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BlockingNode``'s connect waits by default ``connect_timeout + 2 *
    handshake_timeout`` and a second (a dial that loses a simultaneous-dial tie-break
    waits for the winner after its own handshake), and ``handshake_timeout`` more with
    TLS, whose handshake has a deadline of its own. The engine's connect is a FAKE that
    never ends (as one keeping each of those deadlines to its last moment would not, in
    time): the facade's default is what ends the call, and its error says how long."""

    async def never_ends(self: Node, address: tuple[str, int]) -> None:  # FAKE
        await trio.sleep_forever()

    monkeypatch.setattr(Node, "connect", never_ends)
    tls = pki.tls("a") if use_tls else {}
    cfg = config("a", connect_timeout=0.1, handshake_timeout=0.5, **tls)
    expected = 0.1 + (3 if use_tls else 2) * 0.5 + 1.0
    waited = rf"timed out after {re.escape(str(expected))} s"
    with start_node(cfg) as node, pytest.raises(P2PKVTimeout, match=waited):
        node.connect(("127.0.0.1", 1))


# --- the command line ----------------------------------------------------------------------


def test_serve_and_fetch_take_the_tls_files_from_flags_or_a_config_file(
    pki: PKI, tmp_path: Path
) -> None:
    files = {k: os.fspath(v) for k, v in pki.tls("s").items()}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in files.items()]
    cfg, _fill, _seed = serve_settings(build_parser().parse_args(["serve", *flags]))
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == tuple(files.values())

    conf = tmp_path / "conf" / "node.toml"
    conf.parent.mkdir()
    conf.write_text('peer_id = "s"\ntls_cert = "c.pem"\ntls_key = "k.pem"\ntls_ca = "../ca.pem"\n')
    cfg, _fill, _seed = serve_settings(build_parser().parse_args(["serve", "--config", str(conf)]))
    assert cfg.tls_cert == os.fspath(conf.parent / "c.pem")
    assert cfg.tls_ca == os.fspath(conf.parent / "../ca.pem")

    args = build_parser().parse_args(["fetch", "127.0.0.1:1", *flags])
    cfg, _blocks, _seed = fetch_settings(args, "f")
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == tuple(files.values())
    assert cfg.peer_id == "s"  # the one its certificate names
    # The file is the serving node's: its certificate and key are its identity, so a
    # fetch takes its own from the flags (it claimed the server's id: review 2026-12-04),
    # and the file's CA.
    args = build_parser().parse_args(["fetch", "127.0.0.1:1", "--config", str(conf), "--peer-id=f"])
    with pytest.raises(P2PKVError, match="tls_cert and tls_key are the serving node's own"):
        fetch_settings(args, "f")
    own = [f"--tls-cert={files['tls_cert']}", f"--tls-key={files['tls_key']}"]
    args = build_parser().parse_args(["fetch", "127.0.0.1:1", "--config", str(conf), *own])
    cfg, _blocks, _seed = fetch_settings(args, "f")
    assert (cfg.tls_cert, cfg.tls_key) == (files["tls_cert"], files["tls_key"])
    assert cfg.tls_ca == os.fspath(conf.parent / "../ca.pem")


def test_fetch_with_the_servers_file_wants_both_its_own_certificate_and_key(
    pki: PKI, tmp_path: Path
) -> None:
    """Given the serving node's file (its certificate and key are its identity), a fetch
    with only one of --tls-cert and --tls-key is told to give both, by name."""
    files = {k: os.fspath(v) for k, v in pki.tls("f").items()}
    conf = tmp_path / "node.toml"
    conf.write_text('peer_id = "s"\ntls_cert = "c.pem"\ntls_key = "k.pem"\ntls_ca = "ca.pem"\n')
    for flag in ("tls_cert", "tls_key"):
        argv = ["fetch", "127.0.0.1:1", "--config", str(conf), f"--{flag.replace('_', '-')}"]
        args = build_parser().parse_args([*argv[:-1], f"{argv[-1]}={files[flag]}"])
        with pytest.raises(P2PKVError, match="tls_cert and tls_key are the serving node's own"):
            fetch_settings(args, "f")


def test_with_tls_the_peer_id_defaults_to_the_one_the_certificate_names(pki: PKI) -> None:
    """As ``--help`` says: under TLS a node without ``--peer-id`` is the peer its
    certificate names (a HOSTNAME-PID id would fail every handshake); a certificate
    naming several is refused, asking for the id."""
    flags = [f"--{k.replace('_', '-')}={os.fspath(v)}" for k, v in pki.tls("node-a").items()]
    cfg, _fill, _seed = serve_settings(build_parser().parse_args(["serve", *flags]))
    assert cfg.peer_id == "node-a"
    two = [f"--{k.replace('_', '-')}={os.fspath(v)}" for k, v in pki.tls("a", "b").items()]
    with pytest.raises(P2PKVError, match="names 2 peer ids"):
        serve_settings(build_parser().parse_args(["serve", *two]))
    assert cert_file_peer_id(os.fspath(pki.tls("client")["tls_cert"])) == "client"


def test_with_tls_a_certificate_naming_no_peer_id_asks_for_one(pki: PKI) -> None:
    """A certificate with no p2pkv:// URI gives no default peer id: the error asks for
    one (it was an IndexError's traceback when only several names were refused)."""
    flags = [f"--{k.replace('_', '-')}={os.fspath(v)}" for k, v in pki.tls().items()]
    with pytest.raises(P2PKVError, match="names 0 peer ids"):
        serve_settings(build_parser().parse_args(["serve", *flags]))
    cfg, _fill, _seed = serve_settings(build_parser().parse_args(["serve", *flags, "--peer-id=s"]))
    assert cfg.peer_id == "s"


def test_serve_refuses_an_incomplete_set_of_tls_flags(pki: PKI) -> None:
    cert = os.fspath(pki.tls("s")["tls_cert"])
    done = subprocess.run(
        [sys.executable, "-m", "p2pkv", "serve", "--transport", "local", "--tls-cert", cert],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "tls_cert, tls_key and tls_ca together" in done.stderr


async def test_serve_with_tls_flags_refuses_a_plain_peer(pki: PKI) -> None:
    flags = [f"--{k.replace('_', '-')}={os.fspath(v)}" for k, v in pki.tls("s").items()]
    argv = [sys.executable, "-m", "p2pkv", "serve", "--exit-on-eof", "--transport", "local"]
    proc = await trio.lowlevel.open_process(
        [*argv, "--peer-id", "s", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    raw = RawPeer("plain")
    try:
        with trio.fail_after(60):  # a cold Python start on a loaded 2-core box
            assert proc.stdout is not None and proc.stdin is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "serve exited before it listened"
                line += chunk
            host, port = json.loads(line)["address"]
            await raw.connect((host, port))
            raw.proto.start()
            await raw.flush()
            bye = await raw.expect_close()
            assert bye is not None and bye.code == "handshake"
            assert "requires TLS" in bye.reason
            await proc.stdin.aclose()  # --exit-on-eof: a clean stop
            assert await proc.wait() == 0
    finally:
        await raw.aclose()
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


@pytest.mark.parametrize("use_tls", [True, False], ids=["tls", "plain"])
async def test_a_peer_gone_silent_is_dropped_at_idle_timeout_over_tls_too(
    pki: PKI, use_tls: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """Our own keepalive pings are not news from the peer: over TLS every send goes
    through the send deadline's path, and counting its pieces as hearing from the peer kept
    a silent one's session up for ever (found by a review)."""
    kw: dict[str, Any] = {"heartbeat_interval": 2.0, "idle_timeout": 9.0}
    mute = {"on": False}
    tls_a, tls_b = (pki.tls("a"), pki.tls("b")) if use_tls else ({}, {})
    with trio.fail_after(60):
        async with (
            open_node(config("a", **kw, **tls_a), offload=VirtualOffload()) as a,
            open_node(config("b", **kw, **tls_b), offload=VirtualOffload()) as b,
            recording_proxy(a.address, mute) as (address, _),
        ):
            await b.connect(address)
            while not a.peers():
                await trio.sleep(0.01)
            (sa,) = a._by_peer.values()
            mute["on"] = True
            t0 = trio.current_time()
            with trio.move_on_after(40):
                await sa.finished.wait()
            assert sa.finished.is_set(), "a silent peer was never dropped"
            assert sa.close_reason == "idle timeout"
            assert trio.current_time() - t0 <= 9.0 + 2.0


async def test_a_session_closed_as_its_tls_handshake_finishes_ends_without_crashing(
    pki: PKI, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The TLS handshake finishes, and before the session's task runs again it is closed
    (the node shutting down, a stranger turned away: the close lands in the batch in
    which the handshake's wait returned, too late to cancel it). The session must not
    open its handshake on the closed protocol: ``start`` raised ``LocalProtocolError``
    and crashed the session (logged as a crash)."""
    from p2pkv import tls

    real = tls.handshake
    closed: list[object] = []

    async def handshake(stream: trio.abc.Stream, seconds: float) -> None:
        """FAULT INJECTION: the accepting side's session is closed as its handshake ends."""
        await real(stream, seconds)
        for s in list(a._sessions):
            if s.stream is stream:
                s.close("turned away", "busy")
                closed.append(s)

    monkeypatch.setattr(tls, "handshake", handshake)
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a", **pki.tls("a"))) as a,
            open_node(config("b", **pki.tls("b"))) as b,
        ):
            with pytest.raises(P2PKVError):
                await b.connect(a.address)
            assert len(closed) == 1
            while a._sessions:
                await a._peers_changed.park()
            assert not [r for r in caplog.records if "crashed" in r.getMessage()]


@asynccontextmanager
async def choking_proxy(
    target: tuple[str, int], budget: dict[str, int]
) -> AsyncIterator[tuple[str, int]]:
    """A TCP relay to ``target``, its socket to ``target`` with a 4 KiB receive buffer
    from before it connects. Once ``budget["left"]`` is set (bytes), it relays only that
    many more bytes from ``target`` and then stops reading it, while the other direction
    flows: to ``target``, a peer that reads a little and then no more, yet still sends."""

    async def relay(client: trio.SocketStream) -> None:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(target)
        server = trio.SocketStream(sock)
        async with client, server, trio.open_nursery() as nursery:

            async def upstream() -> None:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await client.receive_some(1 << 16):
                        await server.send_all(data)
                nursery.cancel_scope.cancel()

            async def downstream() -> None:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while True:
                        left = budget.get("left")
                        if left == 0:
                            await trio.sleep_forever()  # reads no more
                        data = await server.receive_some(min(left or 1 << 16, 1 << 16))
                        if not data:
                            break
                        if left is not None:
                            budget["left"] = left - len(data)
                        await client.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(upstream)
            nursery.start_soon(downstream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, relay, listeners)
        yield ("127.0.0.1", port)
        nursery.cancel_scope.cancel()


async def test_a_tls_peer_that_stops_reading_mid_frame_is_dropped_though_it_still_pings(
    pki: PKI, autojump_clock: trio.testing.MockClock
) -> None:
    """Over TLS a big frame goes out in pieces, the send deadline moved after each: a
    peer that took the first piece and then read nothing more, while it went on pinging
    us (so it never went quiet), must lose its session once a piece has made no headway
    for ``idle_timeout``. Had the deadline been dropped after the first piece, our send,
    and the send lock with everything queued behind it, waited as long as the peer chose
    (here: until its own, longer, idle timeout gave up on our stuck pongs)."""
    with trio.fail_after(120):
        async with (
            open_node(
                config("a", heartbeat_interval=2.0, idle_timeout=9.0, **pki.tls("a")),
                offload=VirtualOffload(),
            ) as a,
            open_node(
                config("b", heartbeat_interval=2.0, idle_timeout=60.0, **pki.tls("b")),
                offload=VirtualOffload(),
            ) as b,
        ):
            budget: dict[str, int] = {}
            async with choking_proxy(a.address, budget) as address:
                await b.connect(address)
                while not a.peers():
                    await trio.sleep(0.01)
                (sa,) = a._by_peer.values()
                assert isinstance(sa.stream, trio.SSLStream)
                raw = sa.stream.transport_stream
                assert isinstance(raw, trio.SocketStream)
                raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                # A lookup of 4,096 keys (~150 KB, three TLS pieces): the first gets through.
                budget["left"] = 80_000
                keys = [i.to_bytes(4, "big") * 8 for i in range(4096)]

                async def lookup() -> None:
                    with suppress(P2PKVError):
                        await a.lookup("b", keys)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lookup)
                    with trio.move_on_after(40):
                        await sa.finished.wait()
                    nursery.cancel_scope.cancel()
                assert budget["left"] == 0  # it read the first piece, then stopped
                assert sa.close_reason == "peer stopped reading", sa.close_reason


async def test_over_tls_lookups_behind_a_stalled_host_are_answered_within_one_host_wait(
    pki: PKI, autojump_clock: trio.testing.MockClock
) -> None:
    """The reader's bound on host waits looks at what it has not read yet: over TLS
    that includes the bytes trio's TLS layer holds, decrypted or not, as well as the
    socket's (the test in test_host_pins.py, over mutual TLS)."""
    await lookups_behind_a_stalled_host_are_answered_within_one_host_wait(
        src_kw=pki.tls("src"), dst_kw=pki.tls("dst")
    )
