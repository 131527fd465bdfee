"""Pooled shared-memory regions: real files in /dev/shm, a writer and a reader (in one process, and in two).

Reuse happens only after the reader dropped every view; a sweep or a hostile name never lets memory a reader
still sees be written again.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import uuid

import numpy
import pytest
from omnifleet_runtime import shm
from omnifleet_runtime.wire import ShmRef

MiB = 1 << 20


@pytest.fixture
def prefix():
    p = shm.pod_prefix(f"pool-{uuid.uuid4().hex[:8]}")
    yield p
    pool = shm._pools.pop(p, None)
    if pool is not None:
        pool.close()
    shm.sweep(p)


def files(prefix: str) -> list[str]:
    return sorted(n[len(prefix):] for n in os.listdir(shm.shm_dir()) if n.startswith(prefix))


def stem(ref: ShmRef) -> str:
    """The region a reference names (its name without the transfer's generation)."""
    return shm._stem(ref.name)


def send(prefix: str, data: bytes) -> ShmRef:
    ref, moved = shm.offload(data, prefix)
    assert isinstance(ref, ShmRef) and moved == len(data)
    return ref


def test_a_region_is_reused_once_the_reader_dropped_its_view(prefix):
    first = send(prefix, b"a" * MiB)
    view = shm.load(first, prefix)
    assert bytes(view) == b"a" * MiB and view.readonly
    assert files(prefix) == [first.name[len(prefix):] + ".held"]
    del view
    gc.collect()
    for i in range(5):  # every later transfer lands in the same region: no new file, no fresh page
        ref = send(prefix, bytes([i]) * MiB)
        assert stem(ref) == stem(first) and ref.name != first.name
        view = shm.load(ref, prefix)
        assert bytes(view) == bytes([i]) * MiB
        del view
    assert files(prefix) == [stem(first)[len(prefix):] + ".free"]
    with pytest.raises(FileNotFoundError):  # a stale reference finds nothing, not a later transfer's bytes
        shm.load(first, prefix)
    assert shm._pools[prefix].bytes == shm.size_class(MiB)


def test_a_large_buffer_is_copied_in_parallel_parts_whole_and_in_order(prefix, monkeypatch):
    monkeypatch.setattr(shm, "copy_threads", lambda: 3)  # this machine may have fewer cores: the parts still split
    calls = []
    copyto = numpy.copyto

    def counted(dst, src):
        calls.append(dst.nbytes)
        copyto(dst, src)

    monkeypatch.setattr(numpy, "copyto", counted)
    data = os.urandom(3 * shm.COPY_PART + 12345)  # three parts, the last one short
    ref = send(prefix, data)
    view = shm.load(ref, prefix)
    assert bytes(view) == data
    assert len(calls) == 3 and sum(calls) == len(data)
    del view
    small = os.urandom(shm.COPY_PARALLEL_MIN - 1)  # below the threshold: one plain copy
    calls.clear()
    view = shm.load(send(prefix, small), prefix)
    assert bytes(view) == small and calls == []


def test_a_region_a_reader_still_sees_through_a_slice_is_never_written_again(prefix):
    ref = send(prefix, b"k" * MiB)
    view = shm.load(ref, prefix)
    tail = view[-16:]  # a derived view keeps the region, not the view it came from
    del view
    gc.collect()
    others = [send(prefix, b"z" * MiB) for _ in range(3)]
    assert stem(ref) not in {stem(o) for o in others}
    assert bytes(tail) == b"k" * 16
    for o in others:
        assert shm.discard(o, prefix) == 1
    del tail
    gc.collect()
    assert all(n.endswith(".free") for n in files(prefix)), files(prefix)


def test_over_the_cap_a_buffer_goes_to_a_one_shot_file_the_reader_unlinks(prefix, monkeypatch):
    monkeypatch.setattr(shm, "pool_cap", lambda: 2 * MiB)
    held = [shm.load(send(prefix, b"h" * MiB), prefix) for _ in range(2)]  # the pool is full and in use
    ref = send(prefix, b"o" * MiB)
    assert not shm._is_region(ref.name, prefix)
    assert bytes(shm.load(ref, prefix)) == b"o" * MiB
    assert ref.name[len(prefix):] not in files(prefix)
    assert shm._pools[prefix].bytes <= 2 * MiB
    del held
    gc.collect()
    # a class the pool does not have evicts free regions rather than grow past the cap
    big = send(prefix, b"b" * (2 * MiB))
    assert shm._is_region(big.name, prefix) and shm._pools[prefix].bytes <= 2 * MiB
    assert shm.discard(big, prefix) == 1


def test_a_payload_dropped_unread_gives_its_region_back(prefix):
    ref = send(prefix, b"d" * MiB)
    assert shm.discard({"x": [ref]}, prefix) == 1
    assert files(prefix) == [stem(ref)[len(prefix):] + ".free"]
    assert stem(send(prefix, b"e" * MiB)) == stem(ref)


def test_a_sweep_while_a_reader_holds_a_region_never_lets_it_be_reused(prefix):
    ref = send(prefix, b"s" * MiB)
    view = shm.load(ref, prefix)
    assert shm.sweep(prefix) == 1  # at pod start/exit, or by age: unlinks whatever the state
    after = send(prefix, b"t" * MiB)
    assert stem(after) != stem(ref)
    assert bytes(view) == b"s" * MiB  # the reader's mapping outlives the name
    del view
    gc.collect()  # its give-back finds no file: nothing breaks
    assert shm._pools[prefix].bytes == shm.size_class(MiB)  # the swept region was dropped, not reused
    assert bytes(shm.load(after, prefix)) == b"t" * MiB


def test_a_region_is_taken_once_and_only_by_its_own_pod(prefix):
    ref = send(prefix, b"r" * MiB)
    with pytest.raises(ValueError, match="not one of this pod's"):
        shm.load(ref, shm.pod_prefix("another-pod"))
    view = shm.load(ref, prefix)
    with pytest.raises(FileNotFoundError):  # a replayed reference finds the region taken
        shm.load(ref, prefix)
    assert bytes(view) == b"r" * MiB


def test_hostile_region_names_are_left_alone_or_refused(prefix, tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"x" * MiB)
    link = f"{prefix}1-p1.g1"
    os.symlink(target, os.path.join(shm.shm_dir(), link))
    with pytest.raises(OSError):  # O_NOFOLLOW
        shm.load(ShmRef(link, MiB), prefix)
    assert os.path.islink(os.path.join(shm.shm_dir(), link)) and target.read_bytes() == b"x" * MiB

    short = f"{prefix}1-p2.g1"
    with open(os.path.join(shm.shm_dir(), short), "wb") as f:
        f.write(b"y" * 4096)
    with pytest.raises(ValueError, match="has 4096 bytes, expected"):
        shm.load(ShmRef(short, MiB), prefix)  # mapping it would fault past its end
    assert not [n for n in files(prefix) if n.startswith("1-p2")]  # a bad region is unlinked

    with pytest.raises(ValueError, match="not one of this pod's"):
        shm.load(ShmRef(f"{prefix}../../etc/passwd", 10), prefix)


WRITER = """
import json, sys
from omnifleet_runtime import shm
prefix = sys.argv[1]
for line in sys.stdin:
    ref, _ = shm.offload(bytes([int(line)]) * (1 << 20), prefix)
    print(json.dumps([ref.name, ref.size, shm._pools[prefix].bytes]), flush=True)
"""


def test_two_processes_hand_regions_back_and_forth_without_messages(prefix):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, prefix], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        names, pooled = set(), 0
        for i in range(20):
            writer.stdin.write(f"{i}\n")
            writer.stdin.flush()
            name, size, pooled = json.loads(writer.stdout.readline())
            view = shm.load(ShmRef(name, size), prefix)
            assert bytes(view) == bytes([i]) * MiB
            names.add(shm._stem(name))
            del view
        assert len(names) == 1 and pooled == shm.size_class(MiB)  # one region served all twenty
    finally:
        writer.stdin.close()
        writer.wait(timeout=20)
    # the writer's exit unlinks the regions it owns; the reader forgets its mapping at the next sweep
    assert files(prefix) == []
    shm.sweep(prefix)
    assert not [m for m in shm._mapped.values() if m.name.startswith(prefix)]
