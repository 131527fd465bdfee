"""Hand bulk payload bytes to a co-located stage through shared memory.

The sender writes each large buffer to a file in /dev/shm (a memory-backed
emptyDir in a pod) and sends only a ShmRef (its name and size). The receiver
maps the file read-only, unlinks it at once (the mapping outlives the name),
and hands out a view of the mapping: one copy in, zero copies out, nothing on
the network. A pod's leftovers (a receiver that died before reading) are
swept by the pod's parent process when it exits, and vanish with the pod.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import tempfile
from typing import Any

from . import constants as C
from .wire import Array, ShmRef, as_bytes_view, walk

# Buffers smaller than this are not worth a file: they go inline or as frames.
SHM_MIN = 64 * 1024
PREFIX = "omnifleet-"
_NAME = re.compile(r"^omnifleet-[A-Za-z0-9._-]{1,200}$")
_counter = itertools.count()


def shm_dir() -> str:
    return C.SHM_DIR if os.path.isdir(C.SHM_DIR) else tempfile.gettempdir()


def pod_prefix(pod: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9.-]", "-", pod)[:100]
    return f"{PREFIX}{safe}-"


def _write(name: str, view: memoryview) -> None:
    fd = os.open(os.path.join(shm_dir(), name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)


def offload(value: Any, prefix: str) -> tuple[Any, int]:
    """value with its large buffers moved to shared memory, and how many bytes moved."""
    moved = 0

    def leaf(v: Any) -> Any:
        nonlocal moved
        data = v.data if isinstance(v, Array) else v
        if not isinstance(data, (bytes, bytearray, memoryview)) and not isinstance(v, Array):
            return v
        view = as_bytes_view(data)
        if view.nbytes < SHM_MIN:
            return v
        name = f"{prefix}{os.getpid()}-{next(_counter)}"
        _write(name, view)
        moved += view.nbytes
        if isinstance(v, Array):
            return ShmRef(name, view.nbytes, v.dtype, tuple(v.shape))
        return ShmRef(name, view.nbytes)

    return walk(value, leaf), moved


def _read(ref: ShmRef) -> memoryview:
    if not _NAME.match(ref.name):
        raise ValueError(f"bad shared-memory name {ref.name!r}")
    path = os.path.join(shm_dir(), ref.name)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != ref.size:
            raise ValueError(f"shared-memory object {ref.name} has {size} bytes, expected {ref.size}")
        if size == 0:
            return memoryview(b"")
        mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
        os.unlink(path)
    return memoryview(mapping)


def load(value: Any) -> Any:
    """value with every ShmRef replaced by a read-only view of its bytes (or an Array over them)."""

    def leaf(v: Any) -> Any:
        if not isinstance(v, ShmRef):
            return v
        view = _read(v)
        return Array(v.dtype, v.shape, view) if v.dtype is not None else view

    return walk(value, leaf)


def sweep(prefix: str) -> int:
    """Remove this pod's leftover objects; how many there were."""
    n = 0
    for name in os.listdir(shm_dir()):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(shm_dir(), name))
                n += 1
            except FileNotFoundError:
                pass
    return n
