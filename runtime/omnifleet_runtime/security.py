"""The pipeline's keys, and the CurveZMQ / ZAP setup of every ZMQ socket.

A pipeline is one trust domain: every pod of it holds the same keys (the
operator's Secret, mounted as a directory; `omnifleet run` and the tests write
ephemeral ones). Files in that directory:

- `server.public`, `server.secret`: the CURVE keypair of every listening
  socket (the master's control port, each stage's data port);
- `client.public`, `client.secret`: the CURVE keypair every connecting
  socket presents; the ZAP handler admits this public key and no other;
- `token`: the password of ZMQ PLAIN on data ports of a pipeline whose
  `spec.security.dataPlane` is `plain-auth` (authenticated, not encrypted).

Without the client secret key, a peer cannot complete a handshake: nothing it
sends reaches a decoder. The ZAP handler runs in its own thread (pyzmq's
ThreadAuthenticator), so a busy event loop never stalls handshakes.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from . import constants as C

log = logging.getLogger("omnifleet.security")

KEY_FILES = C.KEY_FILES
ZAP_DOMAIN = "omnifleet"
PLAIN_USER = "omnifleet"
CURVE = "curve"
PLAIN_AUTH = "plain-auth"


class KeysError(ValueError):
    """The keys directory is missing or holds something that is not a key; the text names the file."""


@dataclass(frozen=True)
class Keys:
    server_public: bytes  # z85, 40 bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    token: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Keys":
        d = Path(directory)
        if not d.is_dir():
            raise KeysError(f"no keys directory {d} (set --keys-dir or ${C.ENV_KEYS_DIR}; "
                            f"the operator mounts the pipeline's Secret at {C.KEYS_DIR})")
        values = {}
        for name in KEY_FILES:
            try:
                values[name] = (d / name).read_bytes().strip()
            except OSError as e:
                raise KeysError(f"cannot read key file {d / name}: {e.strerror}") from None
        for name in KEY_FILES[:4]:
            v = values[name]
            try:
                if len(v) != 40 or len(z85.decode(v)) != 32:
                    raise ValueError
            except Exception:
                raise KeysError(f"key file {d / name} does not hold a Z85-encoded 32-byte CURVE key") from None
        if len(values["token"]) < 16:
            raise KeysError(f"key file {d / 'token'} holds fewer than 16 bytes")
        if zmq.curve_public(values["server.secret"]) != values["server.public"]:
            raise KeysError(f"{d / 'server.secret'} and {d / 'server.public'} are not one keypair")
        if zmq.curve_public(values["client.secret"]) != values["client.public"]:
            raise KeysError(f"{d / 'client.secret'} and {d / 'client.public'} are not one keypair")
        return cls(values["server.public"], values["server.secret"], values["client.public"],
                   values["client.secret"], values["token"])


def keys_dir(flag: str | None) -> str:
    return flag or os.environ.get(C.ENV_KEYS_DIR) or C.KEYS_DIR


class PipelineAuthenticator(ThreadAuthenticator):
    """ZAP handler admitting only the pipeline's client key (CURVE) or token (PLAIN).

    Compares in constant time; counts refusals in `refused` (read by the master's metrics).
    """

    def __init__(self, context: zmq.Context, keys: Keys):
        super().__init__(context, log=logging.getLogger("omnifleet.zap"))
        self.keys = keys
        self.refused = 0
        self.client_key = z85.decode(keys.client_public)

    def _refuse(self, what: str) -> tuple[bool, bytes]:
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:  # bounded logging under a flood
            log.warning("refused a ZMQ handshake: %s (%d refused so far)", what, self.refused)
        return False, b"not a key of this pipeline"

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        if hmac.compare_digest(client_key, self.client_key):
            return True, b"OK"
        return self._refuse("unknown CURVE client key")

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if hmac.compare_digest(password.encode(), self.keys.token) and username == PLAIN_USER:
            return True, b"OK"
        return self._refuse("wrong PLAIN credentials")


def start_authenticator(ctx: zmq.Context, keys: Keys) -> PipelineAuthenticator:
    """Start the context's ZAP handler; must run before any server socket binds."""
    auth = PipelineAuthenticator(ctx, keys)
    auth.start()
    return auth


def _limits(sock: zmq.Socket, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # the peer is disconnected before the frame is allocated


def secure_server(sock: zmq.Socket, keys: Keys, mode: str = CURVE,
                  max_frame_bytes: int = C.MAX_DATA_FRAME_BYTES) -> None:
    """A listening socket: CURVE server (or PLAIN server), every handshake through ZAP."""
    _limits(sock, max_frame_bytes)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never accept
    if mode == PLAIN_AUTH:
        sock.plain_server = True
    else:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: Keys, mode: str = CURVE,
                  max_frame_bytes: int = C.MAX_DATA_FRAME_BYTES) -> None:
    """A connecting socket: presents the pipeline's client key (or token) and checks the server's key."""
    _limits(sock, max_frame_bytes)
    if mode == PLAIN_AUTH:
        sock.plain_username = PLAIN_USER.encode()
        sock.plain_password = keys.token
    else:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public
