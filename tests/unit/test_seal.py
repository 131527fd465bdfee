"""Sealed large messages (seal.py): what the sender makes, what the receiver opens, and what it refuses.

Real AES-GCM (the `cryptography` package) on real buffers; the processes and sockets around it are in
tests/runtime/test_stripes.py.
"""

from __future__ import annotations

import os

import pytest

from omnifleet_runtime import seal, stripes
from omnifleet_runtime.wire import WireError

MIB = 1 << 20


def opener(max_bytes: int = 1 << 30, ttl_s: float = 60.0, early_max: int = seal.EARLY_MAX_BYTES) -> seal.Opener:
    return seal.Opener(stripes.Assembler(max_bytes, 64), ttl_s, early_max)


def sealed(frames: list) -> tuple[seal.Sealed, list[list]]:
    msg = seal.Sealed(frames, sum(len(f) for f in frames))
    return msg, [msg.seal(p, msg.buffers(p)) for p in range(len(msg.pieces))]


def finish(o: seal.Opener, opened: list) -> list | None:
    out = None
    for key, aead, part, copies in opened:
        seal.unseal(aead, part, copies)
        out = o.assembler.done(key) or out
    return out


def frames_of(size: int) -> list:
    return [b"header-frame", os.urandom(size), bytearray(os.urandom(MIB + 3)), b""]


@pytest.mark.parametrize("announce_at", [0, 1, 3, "end"])
def test_parts_open_exactly_whichever_comes_first(announce_at):
    frames = frames_of(9 * MIB)
    msg, parts = sealed(frames)
    assert len(parts) == -(-sum(len(f) for f in frames) // seal.PART_BYTES) >= 3
    assert all(bytes(p[0]).startswith(seal.BULK_MAGIC) for p in parts)
    assert all(frames[1][:64] not in bytes(piece) for p in parts for piece in p[1:])  # nothing in the clear
    o = opener()
    at = len(parts) if announce_at == "end" else announce_at
    opened = [o.bulk(p) for p in parts[:at]]
    assert opened == [None] * at  # held for the Announce
    opened = o.announce(msg.announce) + [o.bulk(p) for p in parts[at:]]
    out = finish(o, opened)
    assert [bytes(f) for f in out] == [bytes(f) for f in frames]
    assert not o.announced and not o.early and o.early_bytes == 0 and not o.assembler.open


def test_an_altered_piece_does_not_open_and_the_message_is_given_up():
    msg, parts = sealed(frames_of(5 * MIB))
    o = opener()
    o.announce(msg.announce)
    bad = bytearray(parts[1][1])
    bad[100] ^= 1
    opened = o.bulk([parts[1][0], bad, *parts[1][2:]])
    with pytest.raises(WireError, match="does not open"):
        finish(o, [opened])


def test_swapped_parts_do_not_open():
    """Each piece is bound to its (part, index) nonce: the pieces of part 0 sent as part 1 fail."""
    msg, parts = sealed([os.urandom(2 * seal.PART_BYTES)])
    assert len(parts) == 2 and len(parts[0]) == len(parts[1]) == 2
    o = opener()
    o.announce(msg.announce)
    forged = [parts[1][0], *parts[0][1:]]
    with pytest.raises(WireError, match="does not open"):
        finish(o, [o.bulk(forged)])


def test_a_part_without_its_announce_never_opens_and_expires():
    """A peer that has the bulk port's token but no message key: its parts are held, then dropped."""
    msg, parts = sealed(frames_of(2 * MIB))
    o = opener(ttl_s=10.0)
    assert o.bulk(parts[0], now=0.0) is None
    assert o.early_bytes > 0
    assert o.expire(now=5.0) == 0
    assert o.expire(now=11.0) == 1
    assert not o.early and o.early_bytes == 0 and o.dropped == 1


def test_a_part_replayed_after_its_message_finds_no_key():
    msg, parts = sealed(frames_of(2 * MIB))
    o = opener()
    assert finish(o, o.announce(msg.announce) + [o.bulk(p) for p in parts]) is not None
    assert o.bulk(parts[0]) is None  # no key any more: held, never opened
    with pytest.raises(WireError, match="already announced|came twice"):
        o.bulk(parts[0])  # held once; the same again is refused


def test_an_announce_replayed_or_malformed_is_refused():
    msg, parts = sealed(frames_of(2 * MIB))
    o = opener()
    o.announce(msg.announce)
    with pytest.raises(WireError, match="already announced"):
        o.announce(msg.announce)
    for bad in ([seal.ANNOUNCE_MAGIC + b"\xc1"], [seal.ANNOUNCE_MAGIC + b"\x90", b"x"],
                [seal.ANNOUNCE_MAGIC + b"\x94\xc4\x10" + b"k" * 16 + b"\xc4\x03abc\x91\x01\x91\x90"]):
        with pytest.raises(WireError):
            o.announce(bad)


def test_announced_layouts_are_checked_before_anything_is_allocated():
    o = opener(max_bytes=8 * MIB)
    msg, _ = sealed(frames_of(9 * MIB))  # larger than this receiver holds
    with pytest.raises(WireError, match="frames of"):
        o.announce(msg.announce)
    assert not o.announced and o.assembler.held == 0


def test_parts_held_for_announces_stay_within_the_bound():
    o = opener(early_max=3 * seal.PART_BYTES)
    for _ in range(4):
        _, parts = sealed(frames_of(3 * MIB))
        o.bulk(parts[0])  # a part of PART_BYTES and its tags
    assert o.early_bytes <= 3 * seal.PART_BYTES and o.dropped >= 1
    _, parts = sealed([os.urandom(4 * seal.PART_BYTES)])
    with pytest.raises(WireError, match="larger than a part held"):
        opener(early_max=seal.PART_BYTES).bulk([parts[0][0], *(p for part in parts for p in part[1:])])


def test_malformed_bulk_heads_are_refused():
    o = opener()
    for head in (b"", b"OFB1", b"OFB1" + b"k" * 17, b"XXXX" + b"k" * 18):
        with pytest.raises(WireError, match="not a sealed part"):
            o.bulk([head, b"piece"])


def test_pieces_are_sealed_into_reused_buffers():
    """Parts are PART_BYTES exactly (the last one the rest): a message of another size reuses the buffers."""
    msg, parts = sealed([os.urandom(9 * MIB)])
    assert [len(piece) for p in parts for piece in p[1:]] == [seal.PART_BYTES + seal.TAG] * 4 + [MIB + seal.TAG]
    del parts
    before = seal._buffers.reused
    sealed([os.urandom(20 * MIB)])
    assert seal._buffers.reused - before >= 4  # the first message's buffers, let go, sealed the second's
