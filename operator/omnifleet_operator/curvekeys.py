"""A pipeline's keys, made where ZMQ is not installed (the operator's image).

CurveZMQ keys are Curve25519 (X25519) keypairs in Z85 text; libsodium (PyNaCl:
NaCl's Curve25519, on which CurveZMQ is defined) makes them, and tests check them
against libzmq's `zmq.curve_public`. Not `cryptography`: its OpenSSL is many
times libsodium's size in the operator's memory.

`pipeline_keys()` gives the files the runtime reads (see
`omnifleet_runtime.security`): server and client keypairs and a token.
"""

from __future__ import annotations

import os
from pathlib import Path

from nacl.public import PrivateKey

from omnifleet_runtime.constants import KEY_FILES

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85_encode(data: bytes) -> str:
    if len(data) % 4:
        raise ValueError("Z85 encodes multiples of 4 bytes")
    out = []
    for i in range(0, len(data), 4):
        v = int.from_bytes(data[i:i + 4], "big")
        out += [_Z85[(v // 85**p) % 85] for p in range(4, -1, -1)]
    return "".join(out)


def curve_keypair() -> tuple[str, str]:
    """(public, secret), Z85 text, as zmq.curve_keypair gives them."""
    key = PrivateKey.generate()
    return z85_encode(bytes(key.public_key)), z85_encode(bytes(key))


def pipeline_keys() -> dict[str, str]:
    """Fresh contents of every key file of a pipeline."""
    server_public, server_secret = curve_keypair()
    client_public, client_secret = curve_keypair()
    values = (server_public, server_secret, client_public, client_secret, os.urandom(32).hex())
    return dict(zip(KEY_FILES, values))


def write_key_files(directory: Path, keys: dict[str, str]) -> Path:
    """The key files in directory (0700, files 0600), as a mounted Secret holds them."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, value in keys.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
    return directory
