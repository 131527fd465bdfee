"""Hand bulk payload bytes to a co-located stage through shared memory.

The sender copies each large buffer once into a region of /dev/shm (a
memory-backed emptyDir in a pod) and sends only a ShmRef (its name and size);
the receiver hands out a read-only view of the region: one copy in, zero
copies out, nothing on the network.

Regions are pooled, so a transfer pays neither fresh tmpfs pages nor a page
fault per page: each sending process keeps files of a few size classes mapped
(pre-faulted), up to a cap well under the pod's /dev/shm, and the receiver
keeps its read-only mapping of each file. A region's state is its file name,
changed only by rename (one winner, no messages back):

    <stem>.w          the writer's: free, or being written
    <stem>.g<n>       written (the n-th time), in transit: the name in the ShmRef
    <stem>.g<n>.held  a reader took it; its views may still be read
    <stem>.free       the reader's last view is gone: the writer may reuse it

so memory is reused only after its reader dropped every view of it, and a
stale or replayed reference finds no file rather than a later transfer's bytes. A buffer
the pool cannot hold (over the cap) goes to a one-shot file that the reader
maps and unlinks at once, as every file did before the pool.

Every path that drops a payload unread discards it (`discard`: a region goes
back to its writer, a one-shot file is unlinked). A reader takes only names of
its own pod's prefix, opens them with O_NOFOLLOW and checks what it opened (a
regular file of this user, holding the stated size) before it takes it.
Leftovers are swept: by the pod's parent at start and exit, and by each stage
by age (a region not written for that long, whatever its state). Unlinking a
region never harms a reader that still maps it: its writer sees the file gone
and never reuses that memory.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import mmap
import os
import re
import stat
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from . import constants as C
from . import stripes
from .wire import Array, ShmRef, as_bytes_view, walk

# Buffers smaller than this are not worth a file: they go inline or as frames.
SHM_MIN = 64 * 1024
PREFIX = "omnifleet-"
_NAME = re.compile(r"^omnifleet-[A-Za-z0-9._-]{1,200}$")
_REGION = re.compile(r"^\d+-p\d+\.g\d+$")  # what follows the pod prefix in a pooled region's in-transit name
# The pool of one sending process holds at most this share of /dev/shm (two stages share a pod's), and at most POOL_MAX.
POOL_SHARE = 4
POOL_MAX = 2 << 30
# A buffer this large is copied into its region by several threads (numpy lets go of the GIL): one core's
# memcpy does not fill the memory bus (bench/results' data-plane reports: the producer's copy was most of a
# 16 MiB shared-memory boundary). Each part at least COPY_PART: a thread's hand-off costs what a smaller copy does.
COPY_PARALLEL_MIN = 8 << 20
COPY_PART = 4 << 20
COPY_THREADS_MAX = 4
_counter = itertools.count()
_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()


def shm_dir() -> str:
    return C.SHM_DIR if os.path.isdir(C.SHM_DIR) else tempfile.gettempdir()


def pod_prefix(pod: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9.-]", "-", pod)[:100]
    return f"{PREFIX}{safe}-"


def size_class(n: int) -> int:
    """The region size for n bytes: four classes per power of two, so at most a quarter is unused."""
    if n <= SHM_MIN:
        return SHM_MIN
    step = (1 << (n - 1).bit_length()) // 8
    return -(-n // step) * step


def pool_cap() -> int:
    st = os.statvfs(shm_dir())
    return min(POOL_MAX, st.f_blocks * st.f_frsize // POOL_SHARE)


# ------------------------------------------------------------------ writer


class _Region:
    __slots__ = ("stem", "fd", "mapping", "size", "writes")

    def __init__(self, stem: str, fd: int, mapping: mmap.mmap, size: int):
        self.stem, self.fd, self.mapping, self.size, self.writes = stem, fd, mapping, size, 0

    def path(self, state: str = "") -> str:
        return os.path.join(shm_dir(), self.stem + state)

    def close(self, unlink: bool) -> None:
        if unlink:
            # not in transit (its reader may still take it) nor held (a reader's): those go at a sweep
            for state in (".w", ".free"):
                try:
                    os.unlink(self.path(state))
                except FileNotFoundError:
                    pass
        self.mapping.close()
        os.close(self.fd)


class _Pool:
    """One process's regions: `free` are its own (state .w), `out` were sent and come back as .free."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.cap = pool_cap()
        self.free: dict[int, list[_Region]] = {}
        self.out: list[_Region] = []
        self.bytes = 0
        self.ids = itertools.count()

    def take(self, n: int) -> _Region | None:
        size = size_class(n)
        if not self.free.get(size):
            self._reclaim()
        if regions := self.free.get(size):
            return regions.pop()
        while self.bytes + size > self.cap and self._drop_one_free():
            pass
        if self.bytes + size > self.cap:
            return None
        return self._create(size)

    def sent(self, region: _Region) -> None:
        self.out.append(region)

    def lost(self, region: _Region) -> None:
        """A region whose file went away under us (swept): its memory is never reused."""
        self.bytes -= region.size
        region.close(unlink=False)

    def _reclaim(self) -> None:
        for region in list(self.out):
            try:
                os.rename(region.path(".free"), region.path(".w"))
            except FileNotFoundError:
                if os.fstat(region.fd).st_nlink == 0:  # swept or discarded by unlink: drop it
                    self.out.remove(region)
                    self.lost(region)
                continue  # still in transit or held
            self.out.remove(region)
            self.free.setdefault(region.size, []).append(region)

    def _drop_one_free(self) -> bool:
        for regions in self.free.values():
            if regions:
                region = regions.pop()
                self.bytes -= region.size
                region.close(unlink=True)
                return True
        return False

    def _create(self, size: int) -> _Region | None:
        stem = f"{self.prefix}{os.getpid()}-p{next(self.ids)}"
        path = os.path.join(shm_dir(), stem + ".w")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a later write
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.unlink(path)
            os.close(fd)
            return None  # /dev/shm is full: a one-shot file will say so
        self.bytes += size
        return _Region(stem, fd, mapping, size)

    def close(self) -> None:
        for region in [*self.out, *(r for rs in self.free.values() for r in rs)]:
            region.close(unlink=True)
        self.out.clear()
        self.free.clear()
        self.bytes = 0


_pools: dict[str, _Pool] = {}


def _pool(prefix: str) -> _Pool:
    if (pool := _pools.get(prefix)) is None:
        pool = _pools[prefix] = _Pool(prefix)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


def _write_region(pool: _Pool, view: memoryview) -> str | None:
    region = pool.take(view.nbytes)
    if region is None:
        return None
    copy_into(region.mapping, view)
    os.utime(region.fd)  # the sweep's clock: a region ages from its last write
    region.writes += 1
    name = f"{region.stem}.g{region.writes}"
    try:
        os.rename(region.path(".w"), region.path(name[len(region.stem):]))
    except FileNotFoundError:  # swept while it sat free
        pool.lost(region)
        return None
    pool.sent(region)
    return name


@functools.cache
def copy_threads() -> int:
    return max(1, min(COPY_THREADS_MAX, stripes.usable_cores()))


def copy_into(dst: Any, view: memoryview) -> None:
    """dst[:n] = view (n its bytes), in parallel parts when it is large and there are cores for them."""
    n = view.nbytes
    parts = min(copy_threads(), n // COPY_PART) if n >= COPY_PARALLEL_MIN else 1
    if parts < 2:
        dst[:n] = view
        return
    import numpy

    global _copiers
    with _copiers_lock:
        if _copiers is None:
            _copiers = ThreadPoolExecutor(COPY_THREADS_MAX - 1, thread_name_prefix="shm-copy")
    out, src = numpy.frombuffer(dst, numpy.uint8, count=n), numpy.frombuffer(view, numpy.uint8)
    step = -(-n // parts)
    helped = [_copiers.submit(stripes.copy, [(out[i:i + step], src[i:i + step])]) for i in range(step, n, step)]
    try:
        stripes.copy([(out[:step], src[:step])])
    finally:
        wait(helped)  # every part is done (or failed) before the region can be sent or reused
    for f in helped:
        f.result()


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
        name = _write_region(_pool(prefix), view)
        if name is None:
            name = f"{prefix}{os.getpid()}-{next(_counter)}"
            _write(name, view)
        moved += view.nbytes
        if isinstance(v, Array):
            return ShmRef(name, view.nbytes, v.dtype, tuple(v.shape))
        return ShmRef(name, view.nbytes)

    return walk(value, leaf), moved


# ------------------------------------------------------------------ reader

# Regions are mapped read-only through libc: the views handed out are ctypes arrays over that address, whose
# finalizer gives the region back, and a Python mmap object would have to be writable to export such arrays.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapped:
    """A reader's mapping of one region file, kept while the file lives (its inode cannot be reused meanwhile)."""

    __slots__ = ("addr", "size", "name", "views")

    def __init__(self, addr: int, size: int, name: str):
        self.addr, self.size, self.name, self.views = addr, size, name, 0  # name: the last transfer's


_mapped: dict[tuple[int, int], _Mapped] = {}
_mapped_lock = threading.Lock()


def _map(fd: int, st: os.stat_result, name: str) -> _Mapped:
    key = (st.st_dev, st.st_ino)
    with _mapped_lock:
        m = _mapped.get(key)
        if m is not None and m.size == st.st_size:
            m.views += 1
            m.name = name
            return m
        if m is not None:  # cannot happen to a region (fixed size); never trust it
            del _mapped[key]
            _unmap_if_idle(m)
    addr = _libc.mmap(None, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of shared-memory region {name}: {os.strerror(err)}")
    m = _Mapped(addr, st.st_size, name)
    m.views = 1
    with _mapped_lock:
        _mapped[key] = m
    return m


def _unmap_if_idle(m: _Mapped) -> None:
    if m.views == 0 and m.addr:
        _libc.munmap(m.addr, m.size)
        m.addr = 0


def _release(m: _Mapped, held: str, free: str) -> None:
    """The last view of a transfer is gone: the region goes back to its writer."""
    with _mapped_lock:
        m.views -= 1
        if m.views == 0 and all(v is not m for v in _mapped.values()):
            _unmap_if_idle(m)  # forgotten meanwhile (its file is gone)
    try:
        os.rename(held, free)
    except OSError:
        pass  # swept meanwhile: its writer drops it


def _forget_gone() -> None:
    """Unmap idle regions whose files are gone (their writer exited, or a sweep took them)."""
    with _mapped_lock:
        for key, m in list(_mapped.items()):
            if m.views:
                continue
            alive = False
            stem = _stem(m.name)
            for name in (m.name, m.name + ".held", stem + ".w", stem + ".free"):
                try:
                    st = os.stat(os.path.join(shm_dir(), name), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                alive = (st.st_dev, st.st_ino) == key
                break
            if not alive:
                del _mapped[key]
                _unmap_if_idle(m)


def _own(name: str, prefix: str) -> bool:
    return bool(_NAME.match(name)) and name.startswith(prefix)


def _is_region(name: str, prefix: str) -> bool:
    return bool(_REGION.match(name[len(prefix):]))


def _stem(name: str) -> str:
    """A region's file name without its state: what its writer and the .free name go by."""
    return name[: name.rindex(".g")]


def _open(ref: ShmRef, prefix: str) -> tuple[str, int, os.stat_result]:
    if not _own(ref.name, prefix):
        raise ValueError(f"shared-memory name {ref.name!r} is not one of this pod's ({prefix}*)")
    path = os.path.join(shm_dir(), ref.name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"shared-memory object {ref.name} is not a regular file of this user; left alone")
    except BaseException:
        os.close(fd)
        raise
    return path, fd, st


def _read_region(ref: ShmRef, prefix: str) -> memoryview:
    path, fd, st = _open(ref, prefix)
    try:
        held, free = path + ".held", os.path.join(shm_dir(), _stem(ref.name) + ".free")
        os.rename(path, held)  # ours: a second reader of the same name finds nothing
        now = os.stat(held, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise ValueError(f"shared-memory object {ref.name} changed while it was taken; left alone")
        if st.st_size < ref.size:
            os.unlink(held)  # its writer sees it gone and drops it
            raise ValueError(f"shared-memory object {ref.name} has {st.st_size} bytes, expected {ref.size}")
        try:
            m = _map(fd, st, ref.name)
        except OSError:
            os.rename(held, free)  # unread: back to its writer
            raise
    finally:
        os.close(fd)
    view = (ctypes.c_ubyte * ref.size).from_address(m.addr)
    weakref.finalize(view, _release, m, held, free)
    return memoryview(view).cast("B").toreadonly()


def _read(ref: ShmRef, prefix: str) -> memoryview:
    path, fd, st = _open(ref, prefix)
    try:
        os.unlink(path)  # ours: gone whatever comes next
        if st.st_size != ref.size:
            raise ValueError(f"shared-memory object {ref.name} has {st.st_size} bytes, expected {ref.size}")
        if st.st_size == 0:
            return memoryview(b"")
        mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return memoryview(mapping)


def load(value: Any, prefix: str) -> Any:
    """value with every ShmRef replaced by a read-only view of its bytes (or an Array over them).

    Only names of prefix (this pod's) are read. On an error, the value's other files are discarded too.
    """

    def leaf(v: Any) -> Any:
        if not isinstance(v, ShmRef):
            return v
        view = _read_region(v, prefix) if _own(v.name, prefix) and _is_region(v.name, prefix) else _read(v, prefix)
        return Array(v.dtype, v.shape, view) if v.dtype is not None else view

    try:
        return walk(value, leaf)
    except BaseException:
        discard(value, prefix)
        raise


def discard(value: Any, prefix: str) -> int:
    """Give back the regions (unlink the one-shot files) of the ShmRefs in a payload dropped unread,
    of this pod's prefix only; how many."""
    n = 0

    def leaf(v: Any) -> Any:
        nonlocal n
        if isinstance(v, ShmRef) and _own(v.name, prefix):
            path = os.path.join(shm_dir(), v.name)
            try:
                if _is_region(v.name, prefix):
                    st = os.lstat(path)  # give back only what a writer of this pod could have made
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                        return v
                    os.rename(path, os.path.join(shm_dir(), _stem(v.name) + ".free"))
                else:
                    os.unlink(path)
                n += 1
            except OSError:
                pass  # read already, or swept
        return v

    walk(value, leaf)
    return n


def sweep(prefix: str, older_than_s: float | None = None) -> int:
    """Remove this pod's leftover objects (only those older than older_than_s if given); how many."""
    n = 0
    cutoff = None if older_than_s is None else time.time() - older_than_s
    for name in os.listdir(shm_dir()):
        if not _own(name, prefix):
            continue
        path = os.path.join(shm_dir(), name)
        try:
            if cutoff is not None and os.lstat(path).st_mtime > cutoff:
                continue
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    _forget_gone()
    return n


def usage(prefix: str) -> int:
    """Bytes this pod's objects hold now (pooled regions, and one-shot files not yet read)."""
    total = 0
    for name in os.listdir(shm_dir()):
        if name.startswith(prefix):
            try:
                total += os.stat(os.path.join(shm_dir(), name)).st_size
            except FileNotFoundError:
                pass
    return total
