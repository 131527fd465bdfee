"""Splitting a message over several connections and putting it back: round trips in any part order,
and every malformed or hostile part refused (WireError) with what is held bounded."""

from __future__ import annotations

import itertools
import os
import random

import msgspec
import pytest

from omnifleet_runtime import stripes, wire
from omnifleet_runtime.stripes import MAGIC, Assembler, StripeHeader, split


def message(seed: int) -> list:
    rng = random.Random(seed)
    frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))]
    for _ in range(rng.randrange(0, 5)):
        frames.append(rng.randbytes(rng.choice([0, 1, 1000, 4096, 65537, 1 << 20])))
    return frames


def received(part: list) -> list:
    return [bytes(memoryview(f)) for f in part]  # what a receiver holds: its own copies


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 16])
def test_parts_in_any_order_give_the_message_back(seed, n):
    frames = message(seed)
    parts = split(frames, n)
    assert len(parts) == n and all(stripes.is_part(p[0]) for p in parts)
    assert sum(len(memoryview(f)) for p in parts for f in p[1:]) == sum(len(f) for f in frames)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    asm = Assembler(max_bytes=1 << 30, max_frames=64)
    outs = [asm.add(received(parts[i])) for i in order]
    assert outs[:-1] == [None] * (n - 1)
    assert [bytes(memoryview(f)) for f in outs[-1]] == frames
    assert asm.held == 0 and not asm.open


def test_a_real_wire_message_survives_and_whole_pieces_are_not_copied():
    big = bytes(range(256)) * (3 << 12)  # 3 MiB
    frames = wire.encode(wire.Data("r", 0, "a", 5, {"x": wire.Array("uint8", (len(big),), big), "t": "hi"}))
    parts = split(frames, 2)
    asm = Assembler(1 << 30, 64)
    kept = [received(p) for p in parts]
    assert asm.add(kept[1]) is None
    out = asm.add(kept[0])
    msg = wire.decode(out)
    assert msg.seq == 5 and msg.payload["t"] == "hi" and bytes(msg.payload["x"].data) == big
    assert out[0] is kept[0][1]  # frame 0 came whole in part 0: kept as received


def test_pieces_are_at_most_four_mib_and_views_of_the_sender_frames():
    frames = [b"h" * 10, bytes(range(256)) * (9 << 12)]  # a 9 MiB buffer
    parts = split(frames, 2)
    pieces = [f for p in parts for f in p[1:]]
    assert max(len(f) for f in pieces) == stripes.PIECE_MAX and len(pieces) == 5  # 10 B, 4 MiB, rest | 4 MiB, rest
    assert all(isinstance(f, memoryview) for f in pieces)
    asm = Assembler(1 << 30, 64)
    assert asm.add(received(parts[1])) is None
    assert [bytes(memoryview(f)) for f in asm.add(received(parts[0]))] == frames


def test_encrypted_links_split_into_smaller_pieces():
    frames = [b"h" * 10, bytes(range(256)) * (9 << 12)]  # a 9 MiB buffer
    parts = split(frames, 2, stripes.PIECE_MAX_ENCRYPTED)
    pieces = [f for p in parts for f in p[1:]]
    # 10 B, 2 MiB, 2 MiB, rest | 2 MiB, 2 MiB, rest
    assert max(len(f) for f in pieces) == stripes.PIECE_MAX_ENCRYPTED == 2 << 20 and len(pieces) == 7
    asm = Assembler(1 << 30, 64)
    assert asm.add(received(parts[0])) is None
    assert [bytes(memoryview(f)) for f in asm.add(received(parts[1]))] == frames


def test_wire_messages_are_never_mistaken_for_parts():
    for msg in (wire.Data("r", 0, "a", 0, "x"), wire.Data("r", 0, "a", 1, eof=True)):
        assert not stripes.is_part(wire.encode(msg)[0])


def header(**over) -> bytes:
    h = {"key": b"k" * 16, "part": 0, "parts": 2, "sizes": [4, 4], "spans": [(0, 0)]}
    h.update(over)
    return MAGIC + msgspec.msgpack.encode(StripeHeader(**h))


@pytest.mark.parametrize("frames, why", [
    ([MAGIC + b"\xc1"], "stripe header"),
    ([MAGIC + msgspec.msgpack.encode([1, 2, 3])], "stripe header"),
    ([header(parts=0), b"abcd"], "part 0 of 0"),
    ([header(parts=17), b"abcd"], "part 0 of 17"),
    ([header(part=2), b"abcd"], "part 2 of 2"),
    ([header(key=b"short"), b"abcd"], "part 0 of 2"),
    ([header(sizes=[]), b"abcd"], "0 frames"),
    ([header(sizes=[-1, 9]), b"abcd"], "2 frames"),
    ([header(sizes=[1 << 20, 1 << 20]), b"abcd"], "2 frames of 2097152 bytes"),
    ([header(sizes=[1] * 65), b"a"], "65 frames"),
    ([header(), b"abcd", b"e"], "1 spans for 2 pieces"),
    ([header(spans=[(2, 0)]), b"abcd"], "outside its frame"),
    ([header(spans=[(0, 1)]), b"abcd"], "outside its frame"),
    ([header(spans=[(0, -1)]), b"ab"], "outside its frame"),
])
def test_malformed_parts_are_refused_before_anything_is_held(frames, why):
    asm = Assembler(max_bytes=1 << 20, max_frames=64)
    with pytest.raises(wire.WireError, match=why):
        asm.add(frames)
    assert asm.held == 0 and not asm.open


def test_parts_that_disagree_repeat_or_overlap_are_refused():
    asm = Assembler(1 << 20, 64)
    assert asm.add([header(spans=[(0, 0)]), b"abcd"]) is None
    with pytest.raises(wire.WireError, match="came twice"):
        asm.add([header(spans=[(1, 0)]), b"efgh"])
    with pytest.raises(wire.WireError, match="disagree"):
        asm.add([header(part=1, sizes=[4, 5]), b"efgh"])
    with pytest.raises(wire.WireError, match="overlap"):  # frame 0 already came whole
        asm.add([header(part=1, spans=[(0, 2)]), b"cd"])
    assert asm.held == 0 and not asm.open  # a message that cannot complete is not kept
    asm = Assembler(1 << 20, 64)
    asm.add([header(spans=[(0, 0), (1, 0)]), b"ab", b"ef"])
    with pytest.raises(wire.WireError, match="overlap or leave gaps"):  # frame 1's 2nd half never comes
        asm.add([header(part=1, spans=[(0, 1)]), b"bc"])
    assert asm.held == 0 and not asm.open  # a message that cannot complete is not kept


def test_pieces_that_overlap_and_leave_a_gap_of_the_same_size_are_refused():
    """The byte count alone would pass: 4 + 4 bytes into a frame of 8, the second over the first's end. In a
    reused buffer the gap would hold an earlier message's bytes."""
    asm = Assembler(1 << 20, 64)
    assert asm.add([header(sizes=[8], spans=[(0, 0)]), b"abcd"]) is None
    with pytest.raises(wire.WireError, match="overlap or leave gaps"):
        asm.add([header(part=1, sizes=[8], spans=[(0, 2)]), b"efgh"])
    assert asm.held == 0 and not asm.open


def big_message(fill: int) -> list:
    return [b"h" * 10, bytes([fill]) * (9 << 20)]  # a 9 MiB frame: split, so reassembled


def test_a_reassembly_buffer_is_reused_once_nothing_refers_to_it():
    parts = split(big_message(1), 2)
    asm = Assembler(1 << 30, 64)
    assert asm.add(received(parts[0])) is None
    first = asm.add(received(parts[1]))
    assert bytes(memoryview(first[1])[:3]) == b"\x01" * 3
    was = id(first[1])
    del first
    parts = split(big_message(2), 2)
    asm.add(received(parts[1]))
    second = asm.add(received(parts[0]))
    assert id(second[1]) == was and asm.pool.reused == 1  # the same resident buffer, not a fresh map
    assert bytes(memoryview(second[1])) == bytes([2]) * (9 << 20)  # every byte this message's


def test_a_reassembly_buffer_still_in_use_is_not_reused():
    """Any view of it (a numpy array, a memoryview, a send in flight) keeps it: the next message gets its own,
    and what the consumer holds does not change under it."""
    import numpy

    asm = Assembler(1 << 30, 64)
    parts = split(big_message(1), 2)
    asm.add(received(parts[0]))
    held = numpy.frombuffer(asm.add(received(parts[1]))[1], numpy.uint8)  # only the array is kept
    parts = split(big_message(2), 2)
    asm.add(received(parts[0]))
    second = asm.add(received(parts[1]))
    assert asm.pool.reused == 0 and bytes(memoryview(second[1])) == bytes([2]) * (9 << 20)
    assert int(held.min()) == int(held.max()) == 1


def test_a_pool_with_a_maker_of_its_own_reassembles_into_what_it_makes():
    """The maker a torch stage on a GPU sets (pinned host memory) hands out numpy arrays, not maps: messages
    still come back exactly, the arrays are reused, and a piece over a frame that came whole is still refused."""
    import numpy

    made = []  # ids: a reference kept here would keep the array in use

    def make(n):
        a = numpy.empty(n, numpy.uint8)
        made.append(id(a))
        return a

    asm = Assembler(1 << 30, 64)
    asm.pool.make = make
    for fill in (1, 2):
        parts = split(big_message(fill), 2)
        assert asm.add(received(parts[1])) is None
        out = asm.add(received(parts[0]))
        assert id(out[1]) == made[0] and bytes(memoryview(out[1])) == bytes([fill]) * (9 << 20)
        del out
    assert len(made) == 1 and asm.pool.reused == 1
    asm.add([header(spans=[(0, 0)]), b"abcd"])
    with pytest.raises(wire.WireError, match="overlap"):
        asm.add([header(part=1, spans=[(0, 2)]), b"cd"])


def test_a_maker_that_fails_leaves_the_message_in_ordinary_memory(caplog):
    def make(n):
        raise RuntimeError("CUDA error: out of memory")

    asm = Assembler(1 << 30, 64)
    asm.pool.make = make
    parts = split(big_message(3), 2)
    asm.add(received(parts[0]))
    out = asm.add(received(parts[1]))
    assert bytes(memoryview(out[1])) == bytes([3]) * (9 << 20)
    assert "out of memory" in caplog.text


def test_reassembly_buffers_kept_are_bounded_in_bytes_and_idle_time():
    pool = stripes.Pool(max_bytes=20 << 20, idle_s=10)
    for i, n in enumerate((8 << 20, 9 << 20, 10 << 20)):  # none in use once taken: the slots alone refer to them
        pool.take(n, now=i)
    assert sorted(len(b) for b, _ in pool.kept) == [9 << 20, 10 << 20]  # the oldest went: 27 MiB > 20 MiB
    pool.trim(now=11.5)  # 9 MiB handed out at t=1, 10 MiB at t=2
    assert [len(b) for b, _ in pool.kept] == [10 << 20]
    pool.trim(now=12.5)
    assert pool.kept == []
    assert isinstance(pool.take(1 << 20), bytearray) and pool.kept == []  # small ones are not kept


def test_what_waits_for_missing_parts_is_bounded_in_bytes_and_time():
    asm = Assembler(max_bytes=1 << 20, max_frames=64, ttl_s=10)
    for i, t in zip(range(6), itertools.count()):  # six half-messages of 256 KiB each: over the bound
        asm.add([header(key=bytes([i]) * 16, sizes=[256 << 10, 0], spans=[(0, 0)]), b"x" * (128 << 10)], now=t)
        assert asm.held <= 1 << 20
    assert asm.dropped == 2 and len(asm.open) == 4
    assert asm.expire(now=12.5) == 1 and asm.expire(now=100) == 3 and asm.held == 0


def test_a_stage_takes_a_message_of_its_largest_frame_split():
    """A 1 GiB tensor (the data port's largest frame) and its header frame, split: within a stage's bound."""
    from omnifleet_runtime import constants as C

    asm = Assembler(stripes.held_bound(C.MAX_DATA_FRAME_BYTES), C.MAX_FRAMES)
    first = [header(sizes=[100, C.MAX_DATA_FRAME_BYTES], spans=[(0, 0), (1, 0)]), b"h" * 100, b"x" * 10]
    assert asm.add(first) is None and asm.held == 100 + C.MAX_DATA_FRAME_BYTES  # mapped, not touched


@pytest.mark.parametrize("cores, curve, plain", [(1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 4, 2), (16, 8, 8), (192, 8, 8)])
def test_default_streams_follow_the_cores(cores, curve, plain):
    assert stripes.default_streams(True, cores) == curve
    assert stripes.default_streams(False, cores) == plain


def test_default_streams_use_this_process_cores():
    cores = stripes.usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert stripes.default_streams(True) == stripes.default_streams(True, cores)


def _cgroups(tmp_path, proc: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc").write_text(proc)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return stripes.cgroup_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "proc"))


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path):
    # a pod's limit of 2.5 CPUs above a container without one of its own
    got = _cgroups(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/cpu.max": "250000 100000\n", "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "kubepods/cpu.max": "800000 100000\n"})
    assert got == 2.5


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    v1 = _cgroups(tmp_path / "a", "4:cpu,cpuacct:/docker/x\n2:memory:/docker/x\n", {
        "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"})
    assert v1 == 1.5
    unlimited = _cgroups(tmp_path / "b", "1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1\n",
                                                               "cpu/cpu.cfs_period_us": "100000\n"})
    assert unlimited is None
    assert _cgroups(tmp_path / "c", "garbage\n0::/x\n", {"x/cpu.max": "not numbers\n"}) is None
