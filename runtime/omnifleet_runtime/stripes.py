"""Large data-port messages split over several connections, and put back together.

One connection runs on one libzmq I/O thread. A stage therefore keeps
`spec.security.dataStreams` connections to each downstream data port, each
pinned to its own I/O thread (and connected only after the previous one's
handshake, so the receiver's I/O threads take them in turn), and splits a
message of at least STRIPE_MIN_BYTES into one part per connection, in pieces
of at most PIECE_MAX. That is the `plain-auth` data plane, and a `curve` one
whose receiver has no bulk port (seal.py; an older stage): there pieces are of
at most PIECE_MAX_ENCRYPTED, also over a single connection (CurveZMQ encrypts
a large frame much slower than the same bytes in small pieces, and a maximal
frame would outgrow the receiver's size bound once encrypted). The Assembler
here copies split buffers back into one (a buffer that a part holds whole is
kept as received, no copy; seal.py has it open sealed pieces into place), into
buffers it reuses once nothing else refers to them: a fresh one faults in, and
the kernel zeroes, every page.

A part is a multipart message whose frame 0 is MAGIC + a msgpack StripeHeader
and whose other frames are pieces of the original message's frames. Parts of
one message arrive in any order, and may be overtaken by later messages on
another connection: receivers order a request's Data by `seq`, not by
arrival. Everything in a header is checked before anything is allocated for
it; what is held while parts are missing is bounded in bytes and time.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
import time
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from .wire import WireError

log = logging.getLogger("omnifleet.stripes")

MAGIC = b"OFS1"  # never the start of a wire message (a msgpack map or array)
STRIPE_MIN_BYTES = 8 << 20  # below it, one connection is as fast and no reassembly copy is paid
STREAMS_MAX = 16
# The most connections a stage opens when the spec leaves dataStreams out: on a 16-core H200 host, CurveZMQ over
# 16 moved no more, next to the unencrypted data plane, than over 8.
STREAMS_DEFAULT_MAX = 8
ASSEMBLY_TTL_S = 60.0  # a message whose parts have not all come in this long is dropped
PIECE_MAX = 4 << 20  # CurveZMQ encrypts a frame with two scratch copies of it: 4 MiB frames stay in malloc's pools
# Encrypted, smaller pieces overlap one piece's encryption with the last one's decryption sooner: with 8
# streams on an H200 host, CurveZMQ moved more with 2 MiB pieces than with 4 MiB or 1 MiB at every size.
PIECE_MAX_ENCRYPTED = 2 << 20
HUGE_MIN = 2 << 20  # reassembly buffers this large are backed by transparent huge pages where possible
HELD_MIN = 4 << 30  # what a receiver holds for messages whose parts are still coming, at least
POOL_MAX_BYTES = 1 << 30  # reassembly buffers kept for reuse, at most
POOL_IDLE_S = 60.0  # a kept buffer not reused in this long is let go


def default_streams(encrypted: bool, cores: int | None = None) -> int:
    """`spec.security.dataStreams` when the spec leaves it out: parallel connections pay only where there are
    cores to run them. A CurveZMQ connection keeps its I/O thread busy: one per core (the curve data plane's
    connections to a receiver without a bulk port; they also size the ZMQ context's I/O threads). An
    unencrypted one (plain-auth, or a bulk port) is cheap, and splitting costs each side an I/O thread and a
    reassembly copy per connection that one connection carrying the buffer whole does not pay: one per two
    cores (bench/results' wire-security reports: on 2 cores one moved more than 8, on 16 cores 8 moved
    1.7-3.5x what one did)."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(STREAMS_DEFAULT_MAX, cores if encrypted else cores // 2))


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (a container's CPU
    limit), rounded up."""
    n = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(n, math.ceil(quota))) if quota else n


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time the cgroups above this process allow (the smallest quota on the path), None when
    none is set. cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us`)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base, files = os.path.join(root, controllers), ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if not os.path.isdir(base):
                base = os.path.join(root, "cpu")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup, then each above it
            q = _quota(os.path.join(base, *parts[:depth]), files)
            if q is not None:
                found.append(q)
    return min(found) if found else None


def _quota(directory: str, files: tuple[str, ...]) -> float | None:
    values = []
    for name in files:
        try:
            with open(os.path.join(directory, name)) as f:
                values.append(f.read().split())
        except (OSError, ValueError):
            return None
    try:
        if len(files) == 1:  # v2: "max 100000" or "QUOTA PERIOD"
            quota, period = values[0][0], values[0][1]
        else:  # v1: quota -1 means none
            quota, period = values[0][0], values[1][0]
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (IndexError, ValueError):
        return None


def held_bound(max_frame_bytes: int) -> int:
    """A receiver's bound on one message and on all it holds: room for several of its largest frames (a
    message of one maximal frame also has its header frame)."""
    return max(HELD_MIN, 4 * max_frame_bytes)


class StripeHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    key: bytes  # the message's random id (16 bytes)
    part: int
    parts: int
    sizes: list[int]  # every frame's size of the original message
    spans: list[tuple[int, int]]  # (frame index, offset) of each piece this part carries, in order


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StripeHeader)


def is_part(frame: Any) -> bool:
    return bytes(memoryview(frame)[:len(MAGIC)]) == MAGIC


def buffer(n: int) -> Any:
    """A writable zeroed buffer for n reassembled bytes. Large ones are anonymous maps advised to use huge
    pages: copying into fresh 4 KiB pages costs a page fault each (measured 3.7x slower here)."""
    if n < HUGE_MIN:
        return bytearray(n)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP on this kernel: ordinary pages
        pass
    return m


class Pool:
    """Large reassembly buffers, kept to be reused for a message of the same size once nothing but the pool
    refers to them (the message's consumer, every view and every send of it is done). A reused buffer is
    resident: no page faults, no zeroing. Bounded in bytes and in idle time. `make(n)` makes the kept ones (a
    stage whose engine copies its inputs to a GPU sets one that makes pinned host memory)."""

    def __init__(self, max_bytes: int = POOL_MAX_BYTES, idle_s: float = POOL_IDLE_S, min_bytes: int = HUGE_MIN):
        self.max_bytes, self.idle_s, self.min_bytes = max_bytes, idle_s, min_bytes
        self.make: Callable[[int], Any] = buffer
        self.kept: list[list[Any]] = []  # [buffer, last handed out], least recently handed out first
        self.reused = 0

    def take(self, n: int, now: float | None = None) -> Any:
        if n < self.min_bytes:  # cheap to make anew: not kept
            return buffer(n)
        now = time.monotonic() if now is None else now
        for i, slot in enumerate(self.kept):
            if len(slot[0]) == n and _unused(slot):
                del self.kept[i]
                self.reused += 1
                break
        else:
            slot = [self._make(n), now]
        slot[1] = now
        self.kept.append(slot)
        self.trim(now)
        return slot[0]

    def _make(self, n: int) -> Any:
        if self.make is not buffer:
            try:
                return self.make(n)
            except Exception as e:  # pinned memory can run out: the message still lands, in ordinary memory
                log.warning("could not make a %d-byte reassembly buffer (%s: %s); using ordinary memory",
                            n, type(e).__name__, e)
        return buffer(n)

    def trim(self, now: float | None = None) -> None:
        """Let go of the least recently handed out buffers over the bound, and of those idle too long (one
        still in use is freed when its last user lets go of it)."""
        now = time.monotonic() if now is None else now
        total = sum(len(b) for b, _ in self.kept)
        while self.kept and (total > self.max_bytes or now - self.kept[0][1] > self.idle_s):
            total -= len(self.kept.pop(0)[0])


def _unused(slot: list[Any]) -> bool:
    # The slot's reference and getrefcount's own argument: any view, array, tensor or send in flight made
    # from the buffer holds one more (CPython's buffer protocol keeps the exporter alive).
    return sys.getrefcount(slot[0]) == 2


def copy(copies: list[tuple[memoryview, Any]]) -> None:
    """Make a part's copies; numpy lets go of the GIL while it copies, so parts copy in parallel threads."""
    import numpy

    for dst, src in copies:
        numpy.copyto(numpy.frombuffer(dst, numpy.uint8), numpy.frombuffer(src, numpy.uint8))


def split(frames: list[Any], n: int, piece: int = PIECE_MAX) -> list[list[Any]]:
    """The message's frames as n parts of about equal bytes, in pieces of at most `piece` bytes (views of the
    frames: nothing is copied)."""
    sizes, spans, pieces = layout(frames, n, piece)
    key = os.urandom(16)
    return [[MAGIC + _encoder.encode(StripeHeader(key, p, n, sizes, spans[p])), *pieces[p]] for p in range(n)]


def layout(frames: list[Any], n: int, piece: int,
           per: int | None = None) -> tuple[list[int], list[list[tuple[int, int]]], list[list[Any]]]:
    """Every frame's size, and each of n parts' spans (frame index, offset) and pieces (views); parts of `per`
    bytes (the last one the rest), else of about equal bytes."""
    views = [memoryview(f).cast("B") for f in frames]
    sizes = [v.nbytes for v in views]
    per = per or -(-sum(sizes) // n)
    pieces: list[list[Any]] = [[] for _ in range(n)]
    spans: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    part, room = 0, per
    for i, v in enumerate(views):
        off = 0
        while True:
            take = min(room, v.nbytes - off, piece)
            pieces[part].append(v[off:off + take])
            spans[part].append((i, off))
            off += take
            room -= take
            if room == 0 and part < n - 1:
                part, room = part + 1, per
            if off >= v.nbytes:
                break
    return sizes, spans, pieces


class _Open:
    __slots__ = ("parts", "sizes", "bufs", "seen", "filled", "held", "since", "copying", "spans", "whole")

    def __init__(self, parts: int, sizes: list[int], now: float):
        self.parts, self.sizes, self.since = parts, sizes, now
        self.bufs: list[Any] = [None] * len(sizes)
        self.seen: set[int] = set()
        self.filled = self.held = 0
        self.copying = 0  # parts taken whose copies are not done yet
        self.spans: list[tuple[int, int, int]] = []  # (frame, offset, bytes) of every copied piece
        self.whole: set[int] = set()  # frames kept as received (no buffer to copy into)


class Assembler:
    """Parts in, whole messages (their frame lists) out; bounded in bytes held and in time."""

    def __init__(self, max_bytes: int, max_frames: int, ttl_s: float = ASSEMBLY_TTL_S):
        self.max_bytes, self.max_frames, self.ttl_s = max_bytes, max_frames, ttl_s
        self.open: OrderedDict[bytes, _Open] = OrderedDict()
        self.held = 0  # bytes allocated or kept for open messages
        self.dropped = 0  # messages given up (expired, or evicted to stay under max_bytes)
        self.pool = Pool()

    def add(self, frames: list[Any], now: float | None = None) -> list[Any] | None:
        """The whole message once this part completes it, else None; WireError for a part that is not valid."""
        key, copies = self.take(frames, now)
        copy(copies)
        return self.done(key)

    def take(self, frames: list[Any], now: float | None = None) -> tuple[bytes, list[tuple[memoryview, Any]]]:
        """Check and record a part: its message's key, and the copies into split buffers it needs (made by
        the caller, on any thread, before `done(key)`). WireError for a part that is not valid."""
        try:
            h = _decoder.decode(memoryview(frames[0])[len(MAGIC):])
        except Exception as e:
            raise WireError(f"stripe header: {type(e).__name__}: {e}") from None
        self.check(h, STREAMS_MAX)
        return self.take_part(h, frames[1:], now)

    def check(self, h: StripeHeader, parts_max: int) -> None:
        """WireError unless the header's layout is one this receiver may allocate for."""
        if len(h.key) != 16 or not 1 <= h.parts <= parts_max or not 0 <= h.part < h.parts:
            raise WireError(f"stripe header: part {h.part} of {h.parts}")
        if not 1 <= len(h.sizes) <= self.max_frames or min(h.sizes) < 0 or sum(h.sizes) > self.max_bytes:
            raise WireError(f"stripe header: {len(h.sizes)} frames of {sum(h.sizes)} bytes")

    def take_part(self, h: StripeHeader, pieces: list[Any], now: float | None = None,
                  overhead: int = 0) -> tuple[bytes, list[tuple[memoryview, Any]]]:
        """`take` of a checked header and its pieces; with `overhead` (sealed pieces: each is that much longer
        than the bytes it stands for) every piece is a copy (the caller decrypts it into place)."""
        now = time.monotonic() if now is None else now
        if len(h.spans) != len(pieces):
            raise WireError(f"stripe header: {len(h.spans)} spans for {len(pieces)} pieces")
        for (i, off), piece in zip(h.spans, pieces):
            if not 0 <= i < len(h.sizes) or off < 0 or len(piece) < overhead or \
                    off + len(piece) - overhead > h.sizes[i]:
                raise WireError(f"stripe piece ({i}, {off}) of {len(piece)} bytes outside its frame")
        entry = self.open.get(h.key)
        if entry is None:
            entry = self.open[h.key] = _Open(h.parts, h.sizes, now)
        elif entry.parts != h.parts or entry.sizes != h.sizes:
            raise WireError("stripe parts of one message disagree on its layout")
        if h.part in entry.seen:
            raise WireError(f"stripe part {h.part} came twice")
        entry.seen.add(h.part)
        grew, copies = 0, []
        for (i, off), piece in zip(h.spans, pieces):
            n = len(piece) - overhead
            if not overhead and off == 0 and n == h.sizes[i] and entry.bufs[i] is None:
                entry.bufs[i] = piece  # whole: kept as received
                entry.whole.add(i)
                grew += n
            else:
                if entry.bufs[i] is None:
                    entry.bufs[i] = self.pool.take(h.sizes[i], now)
                    grew += h.sizes[i]
                elif i in entry.whole:  # the message cannot complete
                    entry.held += grew
                    self.held += grew
                    self._forget(h.key)
                    raise WireError(f"stripe pieces overlap in frame {i}")
                copies.append((memoryview(entry.bufs[i])[off:off + n], piece))
                entry.spans.append((i, off, n))
            entry.filled += n
        entry.held += grew
        entry.copying += 1
        self.held += grew
        self._bound(keep=h.key)
        return h.key, copies

    def done(self, key: bytes) -> list[Any] | None:
        """A taken part's copies are made: the whole message if it was the last, else None (also when the
        message was dropped meanwhile); WireError if its parts overlap or leave gaps."""
        entry = self.open.get(key)
        if entry is None:
            return None
        entry.copying -= 1
        if len(entry.seen) < entry.parts or entry.copying:
            return None
        self._forget(key)
        if entry.filled != sum(entry.sizes) or not _tiled(entry.spans):
            # A gap in a reused buffer would hand on what an earlier message left there.
            raise WireError("stripe pieces overlap or leave gaps")
        return [b"" if b is None else b for b in entry.bufs]

    def expire(self, now: float | None = None) -> int:
        """Drop messages whose parts stopped coming, and pooled buffers idle too long; how many messages."""
        now = time.monotonic() if now is None else now
        self.pool.trim(now)
        old = [k for k, e in self.open.items() if now - e.since > self.ttl_s]
        for k in old:
            self._forget(k)
        self.dropped += len(old)
        return len(old)

    def _bound(self, keep: bytes) -> None:
        while self.held > self.max_bytes and len(self.open) > 1:
            oldest = next(k for k in self.open if k != keep)
            self._forget(oldest)
            self.dropped += 1
            log.warning("dropped a split message whose parts were still coming: over %d bytes held", self.max_bytes)

    def forget(self, key: bytes) -> None:
        """Give up a message (one of its parts was not valid): what it held is let go."""
        if key in self.open:
            self._forget(key)
            self.dropped += 1

    def _forget(self, key: bytes) -> None:
        entry = self.open.pop(key)
        self.held -= entry.held


def _tiled(spans: list[tuple[int, int, int]]) -> bool:
    """Whether the copied pieces of each frame cover it end to end, none over another (a frame that a piece
    held whole has no span; the byte count, checked too, catches a frame left short)."""
    end: dict[int, int] = {}
    for i, off, n in sorted(spans):
        if off != end.get(i, 0):
            return False
        end[i] = off + n
    return True
