"""Large data-port messages of a `curve` pipeline: AES-256-GCM over a bulk connection, the key over CurveZMQ.

CurveZMQ's cipher (XSalsa20-Poly1305, run by libzmq with two scratch copies
of every frame) moved a third of what the unencrypted data plane moved, even
over one connection per core. AES-GCM with the CPU's AES instructions seals
several GB/s per core and lets go of the GIL, so the sender seals parts of a
message in threads while earlier parts travel and the receiver opens them
straight into the reassembled buffer (no copy beyond the decryption).

A message of at least SEAL_MIN_BYTES goes as:

1. an Announce over the CurveZMQ data connection: a fresh random AES key and
   id for this message, and its layout (every frame's size; each part's
   pieces as (frame, offset));
2. its parts over the stage's bulk port (ZMQ PLAIN with the pipeline's token:
   authenticated, not encrypted): frame 0 is BULK_MAGIC + the id + the part
   number, the others the part's pieces, each sealed with the message's key
   under the nonce (part, piece index).

The key never crosses the network unencrypted and is used for one message
only: a bulk part whose id no Announce named, or whose pieces do not open
under its key, never reaches a decoder (it is held, bounded in bytes and
time, in case its Announce is still coming, then dropped); a part replayed
after its message completed finds no key. Binding each piece to its nonce
makes pieces of one part, or parts of one message, impossible to swap.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import stripes
from .wire import WireError

ANNOUNCE_MAGIC = b"OFA1"  # frame 0 of an Announce on the CurveZMQ data connection
BULK_MAGIC = b"OFB1"  # frame 0 of a sealed part on the bulk port
SEAL_MIN_BYTES = 1 << 20  # smaller messages go over CurveZMQ whole
# Parts of a few MiB: one is sealed while the one before travels and the one before that is opened.
PART_BYTES = 2 << 20
PIECE_BYTES = 2 << 20
PARTS_MAX = 2048  # 4 GiB (what a receiver holds at least: stripes.HELD_MIN) in parts of 2 MiB
TAG = 16  # bytes a sealed piece is longer than what it stands for
# Parts that came before their Announce, held at most: it is sent first, so they are few; this bounds what a
# peer that knows only the bulk port's token can make a stage hold.
EARLY_MAX_BYTES = 256 << 20
ANNOUNCED_MAX = 4096  # messages announced whose parts have not all come
_BULK_HEAD = struct.Struct(">16sH")  # message id, part


class Announce(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    key: bytes  # the message's id (16 random bytes)
    secret: bytes  # its AES-256 key (32 random bytes), for this message only
    sizes: list[int]  # every frame's size of the original message
    spans: list[list[tuple[int, int]]]  # each part's pieces: (frame index, offset)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Announce)
_pool: ThreadPoolExecutor | None = None
# Sealed pieces are written into buffers reused once ZMQ has sent them (fresh ones fault in every page).
_buffers = stripes.Pool(min_bytes=1 << 16)


def threads() -> int:
    """How many threads seal and open parts (the cipher lets go of the GIL): one per usable core."""
    return max(2, stripes.usable_cores())


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(threads(), thread_name_prefix="seal")
    return _pool


def nonce(part: int, index: int) -> bytes:
    return struct.pack(">IQ", part, index)


def is_announce(frame: Any) -> bool:
    return bytes(memoryview(frame)[:len(ANNOUNCE_MAGIC)]) == ANNOUNCE_MAGIC


class Sealed:
    """One outgoing message: its Announce, and each part to seal (`seal(p)`, on any thread) and send."""

    def __init__(self, frames: list[Any], nbytes: int):
        # Parts of PART_BYTES exactly (the last one the rest): messages of any size seal into buffers of the
        # same few sizes, which the pool hands out again.
        parts = max(1, -(-nbytes // PART_BYTES))
        if parts > PARTS_MAX:  # larger than a receiver holds by default: about equal parts
            parts, per = PARTS_MAX, None
        else:
            per = PART_BYTES
        self.sizes, spans, self.pieces = stripes.layout(frames, parts, PIECE_BYTES, per)
        self.key, secret = os.urandom(16), AESGCM.generate_key(256)
        self.aead = AESGCM(secret)
        self.announce = [ANNOUNCE_MAGIC + _encoder.encode(Announce(self.key, secret, self.sizes, spans))]

    def buffers(self, part: int) -> list[Any]:
        """Where the part's pieces are sealed into (taken on the event loop: the pool is not thread-safe)."""
        return [_buffers.take(len(piece) + TAG) for piece in self.pieces[part]]

    def seal(self, part: int, into: list[Any]) -> list[Any]:
        """The part's frames for the bulk port, its pieces sealed into `into` (on any thread)."""
        for i, (piece, buf) in enumerate(zip(self.pieces[part], into)):
            self.aead.encrypt_into(nonce(part, i), piece, None, buf)
        return [BULK_MAGIC + _BULK_HEAD.pack(self.key, part), *into]


class _Announced:
    __slots__ = ("aead", "headers", "left", "since")

    def __init__(self, aead: AESGCM, headers: list[stripes.StripeHeader], since: float):
        self.aead, self.headers, self.left, self.since = aead, headers, set(range(len(headers))), since


class Opener:
    """Announces and sealed parts in (in any order), the Assembler's copies out: each a decryption."""

    def __init__(self, assembler: stripes.Assembler, ttl_s: float = stripes.ASSEMBLY_TTL_S,
                 early_max: int = EARLY_MAX_BYTES):
        self.assembler, self.ttl_s, self.early_max = assembler, ttl_s, early_max
        self.announced: OrderedDict[bytes, _Announced] = OrderedDict()
        self.early: OrderedDict[tuple[bytes, int], tuple[list[Any], int, float]] = OrderedDict()
        self.early_bytes = 0
        self.dropped = 0  # parts held for an Announce that never came (or evicted to stay in bounds)

    def announce(self, frames: list[Any], now: float | None = None) -> list[tuple[bytes, AESGCM, int, list]]:
        """Record an Announce; the parts it completes (that came before it), as `_open` gives them."""
        now = time.monotonic() if now is None else now
        if len(frames) != 1:
            raise WireError(f"announce of {len(frames)} frames")
        try:
            a = _decoder.decode(memoryview(frames[0])[len(ANNOUNCE_MAGIC):])
        except Exception as e:
            raise WireError(f"announce: {type(e).__name__}: {e}") from None
        if len(a.secret) != 32:
            raise WireError("announce: the key is not 32 bytes")
        parts = len(a.spans)
        headers = [stripes.StripeHeader(a.key, p, parts, a.sizes, spans) for p, spans in enumerate(a.spans)]
        for h in headers:
            self.assembler.check(h, PARTS_MAX)
        if a.key in self.announced or a.key in self.assembler.open:
            raise WireError("announce of a message already announced")
        self.announced[a.key] = _Announced(AESGCM(a.secret), headers, now)
        self._bound()
        ready = []
        for p in range(parts):
            held = self.early.pop((a.key, p), None)
            if held is not None:
                self.early_bytes -= held[1]
                ready.append(self._open(a.key, p, held[0], now))
        return ready

    def bulk(self, frames: list[Any], now: float | None = None) -> tuple[bytes, AESGCM, int, list] | None:
        """A sealed part: what `_open` gives once its Announce is here, else None (held for it)."""
        now = time.monotonic() if now is None else now
        head = memoryview(frames[0])
        if len(head) != len(BULK_MAGIC) + _BULK_HEAD.size or bytes(head[:len(BULK_MAGIC)]) != BULK_MAGIC:
            raise WireError("not a sealed part")
        key, part = _BULK_HEAD.unpack(head[len(BULK_MAGIC):])
        if key in self.announced:
            return self._open(key, part, frames[1:], now)
        nbytes = sum(len(f) for f in frames)
        if (key, part) in self.early or nbytes > self.early_max:
            raise WireError("sealed part came twice, or larger than a part held for its announce may be")
        self.early[(key, part)] = (frames[1:], nbytes, now)
        self.early_bytes += nbytes
        self._bound()
        return None

    def _open(self, key: bytes, part: int, pieces: list[Any], now: float) -> tuple[bytes, AESGCM, int, list]:
        """(message key, cipher, part, copies): the caller opens each piece into its place (`unseal`), then
        calls the Assembler's done(key)."""
        a = self.announced[key]
        if part not in a.left:
            raise WireError(f"sealed part {part} not announced, or came twice")
        a.left.discard(part)
        if not a.left:
            del self.announced[key]
        try:
            key, copies = self.assembler.take_part(a.headers[part], pieces, now, overhead=TAG)
        except WireError:
            self.announced.pop(key, None)
            raise
        return key, a.aead, part, copies

    def expire(self, now: float | None = None) -> int:
        """Drop Announces and parts held longer than the TTL; how many parts were dropped."""
        now = time.monotonic() if now is None else now
        before = self.dropped
        while self.announced and now - next(iter(self.announced.values())).since > self.ttl_s:
            self.announced.popitem(last=False)
        while self.early and now - next(iter(self.early.values()))[2] > self.ttl_s:
            self._drop_early()
        return self.dropped - before

    def _bound(self) -> None:
        while self.early_bytes > self.early_max:
            self._drop_early()
        while len(self.announced) > ANNOUNCED_MAX:
            self.announced.popitem(last=False)
            self.dropped += 1

    def _drop_early(self) -> None:
        _, (_, nbytes, _) = self.early.popitem(last=False)
        self.early_bytes -= nbytes
        self.dropped += 1



def unseal(aead: AESGCM, part: int, copies: list[tuple[memoryview, Any]]) -> None:
    """Open a part's pieces into their places; WireError if one does not open (forged, altered, swapped)."""
    for i, (dst, src) in enumerate(copies):
        try:
            aead.decrypt_into(nonce(part, i), memoryview(src), None, dst)
        except InvalidTag:
            raise WireError(f"sealed piece {i} of part {part} does not open under its message's key") from None
