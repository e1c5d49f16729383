"""Optional mutual TLS for the control connection.

Theory of operation
-------------------
With ``tls_cert``, ``tls_key`` and ``tls_ca`` configured, every control connection of a
node, accepted or dialed, is a :class:`trio.SSLStream`. Both sides present a certificate
and require one from the peer that chains to the configured CA (``CERT_REQUIRED`` both
ways, TLS 1.3 at least). Host names are not checked: peers are named by peer id, not by
DNS. Instead a certificate names exactly one peer id, as a subject-alternative-name URI
``p2pkv://<peer id>`` (see :func:`peer_uri`), and :func:`check_peer_id` holds the peer's
hello to it: the session calls it the moment the hello is decoded, before the node acts
on the hello in any way (admission, registration), so a certificate for one peer can never
be used to speak as another.

The TLS handshake runs in the session's own task, under ``handshake_timeout``
(:func:`handshake`), never in the accept loop: a slow or silent client costs only its own
connection. A failed TLS handshake is that connection's :class:`HandshakeRejected` (a
timeout its :class:`P2PKVTimeout`). A peer that speaks plain p2pkv to a TLS node gets a
plaintext ``bye`` saying that TLS is required, so its error says what is wrong; except a
plain dialer with a secret, which says nothing until it is challenged: both sides then
wait, and each ends at its handshake deadline with a :class:`P2PKVTimeout`.

TLS protects the control connection only (hellos, lookups, fetch requests, outcomes,
checksums). The NIXL data plane moves block bytes over UCX (shared memory, TCP, RDMA) in
the clear and unauthenticated by TLS.
"""

from __future__ import annotations

import logging
import ssl
import urllib.parse
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .errors import HandshakeRejected, P2PKVError, P2PKVTimeout
from .wire import Bye, encode

if TYPE_CHECKING:
    from .config import NodeConfig

log = logging.getLogger("p2pkv.tls")

URI_SCHEME = "p2pkv://"
REQUIRED = "this node requires TLS (configure tls_cert, tls_key and tls_ca)"
LINGER = 0.25  # seconds we wait for a plaintext peer to read our bye before closing
# OpenSSL's reasons when the first bytes are not a TLS record at all.
_NOT_TLS = frozenset(
    {
        "WRONG_VERSION_NUMBER",
        "UNKNOWN_PROTOCOL",
        "HTTP_REQUEST",
        "HTTPS_PROXY_REQUEST",
        "PACKET_LENGTH_TOO_LONG",
        "RECORD_LAYER_FAILURE",
        "UNEXPECTED_RECORD",
    }
)


@attrs.frozen
class TLSContexts:
    """The two contexts of one node: for accepted and for dialed connections."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def peer_uri(peer_id: str) -> str:
    """The subject-alternative-name URI a certificate for ``peer_id`` carries."""
    return URI_SCHEME + urllib.parse.quote(peer_id, safe="")


def _canonical_peer_id(uri: str) -> str | None:
    """The peer id ``uri`` names if it is that id's one spelling (:func:`peer_uri`), else
    None. A CA issues, and name constraints judge, the literal string: ``p2pkv://%62``
    must not pass for ``p2pkv://b``, nor two non-UTF-8 spellings decode to one id."""
    try:
        peer_id = urllib.parse.unquote(uri[len(URI_SCHEME) :], errors="strict")
    except UnicodeDecodeError:
        return None
    return peer_id if peer_uri(peer_id) == uri else None


def cert_peer_ids(cert: dict[str, Any]) -> list[str | None]:
    """The peer ids a certificate (as :meth:`ssl.SSLSocket.getpeercert` returns it)
    names, one per ``p2pkv://`` URI; None for a URI not in its id's canonical spelling,
    which names no peer (and makes the certificate name none for :func:`check_peer_id`)."""
    return [
        _canonical_peer_id(value)
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and value.startswith(URI_SCHEME)
    ]


def _cert_uris(cert: dict[str, Any]) -> list[str]:
    return [
        value
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and value.startswith(URI_SCHEME)
    ]


def cert_file_peer_id(path: str) -> str:
    """The one peer id the certificate in the PEM file ``path`` names (a node's default
    peer id under TLS). P2PKVError if it names none or several, or cannot be read."""
    import _ssl

    decode = getattr(_ssl, "_test_decode_cert", None)  # CPython's reader of a PEM file
    if decode is None:
        raise P2PKVError(f"cannot read the peer id {path} names here: give the peer id")
    try:
        ids = cert_peer_ids(decode(path))
    except (OSError, ssl.SSLError) as exc:
        raise P2PKVError(f"cannot read the certificate {path}: {exc}") from exc
    if len(ids) != 1:
        raise P2PKVError(
            f"the certificate {path} names {len(ids)} peer ids ({URI_SCHEME}...): give the peer id"
        )
    if ids[0] is None:
        raise P2PKVError(
            f"the certificate {path} names its peer id in a spelling other than {URI_SCHEME}"
            "<percent-encoded id> (p2pkv.tls.peer_uri): it names no peer"
        )
    return ids[0]


def _context(purpose: int, cfg: NodeConfig) -> ssl.SSLContext:
    assert cfg.tls_cert is not None and cfg.tls_key is not None and cfg.tls_ca is not None
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # peers are named by peer id: see check_peer_id
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    ctx.load_verify_locations(cafile=cfg.tls_ca)
    return ctx


def load_contexts(cfg: NodeConfig) -> TLSContexts | None:
    """The node's TLS contexts, or ``None`` when TLS is not configured.

    Raises :class:`P2PKVError` when a file is missing or unreadable, or the key does not
    belong to the certificate."""
    if cfg.tls_cert is None:
        return None
    try:
        return TLSContexts(
            server=_context(ssl.PROTOCOL_TLS_SERVER, cfg),
            client=_context(ssl.PROTOCOL_TLS_CLIENT, cfg),
        )
    except (OSError, ssl.SSLError) as exc:
        raise P2PKVError(f"cannot load the TLS certificate, key or CA: {exc}") from exc


def wrap(
    stream: trio.abc.Stream, contexts: TLSContexts | None, *, server_side: bool
) -> trio.abc.Stream:
    """``stream`` inside TLS when ``contexts`` is set, else ``stream`` itself. No I/O: the
    handshake happens in :func:`handshake`."""
    if contexts is None:
        return stream
    if server_side:
        return trio.SSLStream(stream, contexts.server, server_side=True)
    return trio.SSLStream(stream, contexts.client, server_side=False)


async def handshake(stream: trio.abc.Stream, seconds: float) -> None:
    """Finish the TLS handshake of ``stream`` within ``seconds`` (nothing to do on
    a plain stream).

    Raises :class:`HandshakeRejected` when it fails (the stream is then broken) and
    :class:`P2PKVTimeout` when the peer is too slow."""
    if not isinstance(stream, trio.SSLStream):
        return
    try:
        with trio.fail_after(seconds):
            await stream.do_handshake()
    except trio.TooSlowError:
        raise P2PKVTimeout("TLS handshake timed out", op="handshake") from None
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLError) and cause.reason in _NOT_TLS:
            if stream.server_side:
                with trio.move_on_after(seconds):
                    await _refuse_plaintext(stream.transport_stream)
            raise HandshakeRejected(f"peer does not speak TLS ({cause.reason})") from exc
        raise HandshakeRejected(f"TLS handshake failed: {_describe(cause)}") from exc


async def _refuse_plaintext(transport: trio.abc.Stream) -> None:
    """Tell a plain p2pkv peer, in its own language, why it is refused: a ``bye``, then a
    half-close and a short drain so that closing does not reset the bye away."""
    try:
        await transport.send_all(encode(Bye(code="handshake", reason=REQUIRED)))
        if isinstance(transport, trio.abc.HalfCloseableStream):
            await transport.send_eof()
        with trio.move_on_after(LINGER):
            while await transport.receive_some(1 << 16):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _describe(cause: BaseException | None) -> str:
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError) and cause.reason:
        return str(cause.reason)
    return str(cause) if cause is not None else "connection closed"


REFUSED_HINT = (
    "the peer closed the connection after the TLS handshake, before its first frame: under "
    "TLS 1.3 that is how a node refuses our certificate (its log says why)"
)


def describe_loss(stream: trio.abc.Stream, exc: BaseException, *, heard: bool) -> str:
    """Why ``stream`` was lost, for the session's error: ``exc``'s text, or (a TLS
    stream's BrokenResourceError has none) its cause's. On a connection we dialed over TLS
    on which the peer sent no frame (``heard`` False), also what such a close means: a
    TLS 1.3 client's handshake ends before the server has judged its certificate, and a
    refusal then reaches it as a bare close."""
    why = str(exc) or _describe(exc.__cause__)
    if isinstance(stream, trio.SSLStream) and not stream.server_side and not heard:
        why = f"{why}; {REFUSED_HINT}"
    return why


def check_peer_id(stream: trio.abc.Stream, peer_id: str) -> None:
    """Hold the peer's hello to its certificate: on a TLS stream, the certificate must name
    ``peer_id`` and no other. Raises :class:`HandshakeRejected` (nothing to check on a
    plain stream)."""
    if not isinstance(stream, trio.SSLStream):
        return
    cert = stream.getpeercert()
    named = cert_peer_ids(cert) if cert else []
    if named != [peer_id]:
        uris = _cert_uris(cert) if cert else []
        shown = ", ".join(
            repr(n) if n is not None else f"{u!r} (not the canonical spelling of an id)"
            for n, u in zip(named, uris, strict=True)
        )
        shown = shown or f"no {URI_SCHEME} URI"
        raise HandshakeRejected(
            f"certificate names {shown}, but the hello says {peer_id!r}", peer=peer_id
        )


__all__ = [
    "TLSContexts",
    "cert_peer_ids",
    "check_peer_id",
    "describe_loss",
    "handshake",
    "load_contexts",
    "peer_uri",
    "wrap",
]
