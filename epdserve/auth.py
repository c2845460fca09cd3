"""The cluster secret, and how each channel between processes proves it.

One secret per cluster: ``epdserve serve`` generates it (or reads ``--cluster-key-file``) and
hands it to the workers it starts through their environment (``$EPDSERVE_CLUSTER_KEY``, never
their command line); a worker started by hand reads the same file or variable. Whoever holds
the secret is a member of the cluster; nobody else gets a frame read.

- Router <-> worker control (ZMQ): CURVE. Both key pairs are derived from the secret, so the
  router admits exactly the client key the secret gives (ZAP) and a worker knows the router's
  public key before it connects: a stranger fails the handshake, and the traffic is encrypted.
- KV and embedding-slab TCP connections: a challenge-response handshake before any frame is
  read (``accept_peer`` on the listener, ``prove_to_peer`` on the connecting side), each side
  proving the secret to the other with an HMAC over both sides' nonces. The bulk bytes that
  follow are authenticated by the connection, not encrypted (run them on a network you trust
  with the cluster's traffic, as with NCCL or Mooncake).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
from collections.abc import Iterator

import zmq
from zmq.utils import z85

from epdserve.envs import get_cluster_key
from epdserve.errors import ConfigError

KEY_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
_NONCE_BYTES = 32
_MAGIC = b"EPDSRV1"
_PROOF = struct.Struct(f"!{_NONCE_BYTES}s32s")


class AuthError(ConnectionError):
    """A peer did not prove the cluster secret (or broke off the handshake)."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def parse_key(text: str, source: str) -> bytes:
    """A key as written in a file or the environment: 64 hexadecimal digits."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{source}: the cluster key must be {2 * KEY_BYTES} hexadecimal digits") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{source}: the cluster key must be {2 * KEY_BYTES} hexadecimal digits, got {len(key) * 2}")
    return key


def read_key_file(path: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the cluster key file {path}: {e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the cluster key file {path} is readable by others: chmod 600 it")
    return parse_key(text, path)


def write_key_file(path: str, key: bytes) -> None:
    """Write ``key`` to a new file only its owner can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")


def worker_key(key_file: str | None) -> bytes:
    """A worker's cluster key: ``--cluster-key-file``, else ``$EPDSERVE_CLUSTER_KEY``."""
    if key_file:
        return read_key_file(key_file)
    text = get_cluster_key()
    if text is None:
        raise ConfigError("no cluster key: pass --cluster-key-file (the file `epdserve serve --cluster-key-file` "
                          "wrote) or set EPDSERVE_CLUSTER_KEY")
    return parse_key(text, "EPDSERVE_CLUSTER_KEY")


def serve_key(key_file: str | None) -> bytes:
    """The router's cluster key: read from ``key_file`` when it exists, else generated (and
    written there when a path was given, for workers started by hand)."""
    if key_file and os.path.exists(key_file):
        return read_key_file(key_file)
    key = new_key()
    if key_file:
        write_key_file(key_file, key)
    return key


# -- ZMQ CURVE --------------------------------------------------------------------------
def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, b"epdserve/" + label, hashlib.sha256).digest()


def curve_keypair(key: bytes, side: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of ``side`` ("server" or "client") for ``key``."""
    secret_z85 = z85.encode(_derive(key, f"curve-{side}".encode()))
    return zmq.curve_public(secret_z85), secret_z85


def make_curve_server(sock: zmq.Socket, key: bytes) -> None:
    public, secret = curve_keypair(key, "server")
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def make_curve_client(sock: zmq.Socket, key: bytes) -> None:
    """Before ``connect``: this socket proves ``key`` and checks the router holds it too."""
    public, secret = curve_keypair(key, "client")
    sock.curve_serverkey = curve_keypair(key, "server")[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret


class CurveGate:
    """ZAP for one ZMQ context: admits the client key the cluster secret derives, no other.
    Runs in a thread of its own (the router's event loop is not on the handshake's path)."""

    def __init__(self, ctx: zmq.Context, key: bytes) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        self._auth.start()
        self._auth.certs["*"] = {curve_keypair(key, "client")[0]: True}
        self._auth.allow_any = False

    def stop(self) -> None:
        self._auth.stop()


# -- TCP handshake ----------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _mac(key: bytes, purpose: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, _MAGIC + purpose + side + server_nonce + client_nonce, hashlib.sha256).digest()


@contextlib.contextmanager
def _handshake(conn: socket.socket, timeout_s: float) -> Iterator[None]:
    """The handshake's deadline on ``conn`` (restored after); a socket error is an AuthError."""
    previous = conn.gettimeout()
    conn.settimeout(timeout_s)
    try:
        yield
    except (OSError, struct.error) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"handshake failed: {e}") from None
    finally:
        try:
            conn.settimeout(previous)
        except OSError:
            pass


def accept_peer(conn: socket.socket, key: bytes, purpose: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Listener side: the connecting peer must prove ``key`` for ``purpose`` (b"kv", b"slab")
    within ``timeout_s``; raises AuthError otherwise. Then this side proves it back."""
    with _handshake(conn, timeout_s):
        server_nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(_MAGIC + server_nonce)
        client_nonce, proof = _PROOF.unpack(_recv_exact(conn, _PROOF.size))
        if not hmac.compare_digest(proof, _mac(key, purpose, b"C", server_nonce, client_nonce)):
            raise AuthError("the peer does not hold the cluster key")
        conn.sendall(_mac(key, purpose, b"S", server_nonce, client_nonce))


def prove_to_peer(conn: socket.socket, key: bytes, purpose: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Connecting side of ``accept_peer``: raises AuthError when the listener does not hold
    ``key`` (or refused this side's proof)."""
    with _handshake(conn, timeout_s):
        hello = _recv_exact(conn, len(_MAGIC) + _NONCE_BYTES)
        if not hello.startswith(_MAGIC):
            raise AuthError("the peer is not an epdserve listener")
        server_nonce = hello[len(_MAGIC):]
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(_PROOF.pack(client_nonce, _mac(key, purpose, b"C", server_nonce, client_nonce)))
        answer = _recv_exact(conn, 32)
        if not hmac.compare_digest(answer, _mac(key, purpose, b"S", server_nonce, client_nonce)):
            raise AuthError("the listener does not hold the cluster key")
