"""Typed, versioned messages between master and stages, and their framing.

One message is one ZMQ multipart message: frame 0 is the msgpack-encoded
message (a member of the tagged union `Message`); frames 1.. are raw buffers
that payload values refer to by index (bulk bytes and arrays), so senders pass
them to ZMQ with copy=False and receivers get views of the received frames.

Nothing is ever unpickled. A frame list that does not decode into a known
message, or whose buffer references do not match its frames, raises
WireError; callers log it and go on.

Pure on purpose: msgspec and the standard library only, no sockets, no engines.
"""

from __future__ import annotations

import math
import threading
from typing import Annotated, Any, Callable, Union

import msgspec

from .constants import PROTOCOL_VERSION

# Bytes-like payload values at least this long travel as their own frame;
# shorter ones are cheaper inline.
INLINE_MAX = 1024

EXT_BLOB = 1  # header: [frame index]
EXT_ARRAY = 2  # header: [frame index, dtype, shape]
EXT_SHM = 3  # header: [name, size, dtype | None, shape | None]
EXT_CUDA_IPC = 4  # header: the fields of CudaIpc, in order

# Element sizes of the array dtypes the wire accepts (no numpy needed to check them).
DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
}


class WireError(ValueError):
    """A frame list that is not a valid message; the text says why."""


# ---------------------------------------------------------------- payload values


class Array(msgspec.Struct, frozen=True):
    """A dense C-contiguous array as raw bytes: what a tensor becomes on the wire."""

    dtype: str
    shape: tuple[int, ...]
    data: Any  # a buffer: bytes, memoryview, a ZMQ frame


class ShmRef(msgspec.Struct, frozen=True):
    """Bytes a co-located sender left in shared memory; only the name travels.

    With dtype and shape it stands for an Array, without for plain bytes.
    """

    name: str
    size: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


class CudaIpc(msgspec.Struct, frozen=True, array_like=True):
    """A CUDA tensor a co-located stage hands over by its CUDA IPC handle; only the handle travels.

    The fields are what torch's own CUDA tensor sharing passes between processes (plain values, never
    pickled): the allocation's handle, the storage's place in it, the producer's reference counter
    (the producer keeps the memory until the consumer lets its tensor go) and the event the consumer
    waits on before reading.
    """

    device: int
    handle: bytes
    storage_size: int  # bytes
    storage_offset: int  # bytes into the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements into the storage

    def check(self) -> "CudaIpc":
        """Itself, or ValueError naming what cannot describe a tensor inside its storage."""
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"cuda ipc: unknown dtype {self.dtype!r}")
        ints = (self.device, self.storage_size, self.storage_offset, self.ref_counter_offset, self.offset,
                *self.shape, *self.stride)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints):
            raise ValueError("cuda ipc: a negative or non-integer size, offset, shape or stride")
        if len(self.shape) != len(self.stride) or not 0 < len(self.handle) <= 256 \
                or not 0 < len(self.ref_counter_handle) <= 256:
            raise ValueError("cuda ipc: shape and stride differ in length, or a handle is empty or too long")
        if self.shape and math.prod(self.shape):
            last = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride))
            if (last + 1) * DTYPE_SIZES[self.dtype] > self.storage_size:
                raise ValueError(f"cuda ipc: a {self.dtype}{list(self.shape)} tensor does not fit its "
                                 f"{self.storage_size}-byte storage")
        return self


_cuda_ipc_decoder = msgspec.msgpack.Decoder(CudaIpc)


def walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild dicts, lists and tuples (tuples become lists), mapping every other value through leaf."""
    if isinstance(value, dict):
        return {k: walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [walk(v, leaf) for v in value]
    return leaf(value)


def array_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    return DTYPE_SIZES[dtype] * math.prod(shape)


def as_bytes_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# ---------------------------------------------------------------- messages


class Msg(msgspec.Struct, tag_field="t", tag=True):
    """Base of every message; the tag is the class name."""


class RequestInfo(msgspec.Struct):
    """What every stage (and its input processor) may know of the client request."""

    request_id: str
    kind: str  # the API: "chat", "completion", "image", "speech", "transcription"
    model: str
    prompt: Any = None
    messages: list[Any] | None = None
    extra: dict[str, Any] = {}
    lora: str = ""  # the LoRA adapter `model` named; stages that list it run it


class Route(msgspec.Struct):
    """Where a stage sends its output for one request: a downstream replica's data port."""

    stage: str
    replica: str
    addr: str
    local: bool = False  # same pod: bulk data goes through shared memory
    cuda_ipc: bool = False  # same pod and a consumer that takes CUDA tensors: they go by IPC handle
    bulk: str = ""  # the replica's bulk port (a `curve` pipeline's sealed large messages: seal.py), if it has one


# stage -> master (control socket)


class Register(Msg):
    stage: str
    replica: str
    protocol_version: int
    config_hash: str
    data_addr: str
    pid: int = 0
    bulk_addr: str = ""  # a `curve` pipeline's bulk port (seal.py); empty: none
    engine: str = ""
    # The replica's revision of its stage, and the revision of every stage in the config it runs, with that
    # config's generation: the master routes a request only through replicas of one such map.
    revision: str = ""
    generation: int = 0
    revisions: dict[str, str] = {}


class StageHeartbeat(Msg):
    inflight: int = 0
    queue_depth: int = 0
    draining: bool = False
    bytes_tcp: int = 0  # payload bytes sent to downstream stages over the network
    bytes_shm: int = 0  # payload bytes handed to co-located stages through shared memory
    bytes_master: int = 0  # final-output bytes sent to the master
    dropped: int = 0  # messages this replica dropped over the frame-count or size bounds


class Output(Msg):
    """A chunk of a final output, on its way to the client."""

    request_id: str
    attempt: int
    stage: str
    seq: int
    payload: Any = None


class Done(Msg):
    """A stage finished its part of a request (error set when it failed)."""

    request_id: str
    attempt: int
    stage: str
    chunks: int = 0
    error: str | None = None
    bad_input: bool = False  # the request itself was wrong: the client gets 400
    # Tokens the stage's engine read and wrote for this request (0: none reported, e.g. a python stage).
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class ControlReply(Msg):
    call_id: str
    ok: bool
    result: Any = None
    error: str | None = None


class Deregister(Msg):
    reason: str = ""


# master -> stage (control socket)


class RegisterReply(Msg):
    ok: bool
    master_id: str
    protocol_version: int
    reason: str = ""
    serving: bool = True  # see MasterHeartbeat.serving


class MasterHeartbeat(Msg):
    master_id: str
    # Whether the master routes new requests to this replica's revision (None: no news, a probe). A
    # replica of a new revision waits, unready, until every stage of its revision has a replica.
    serving: bool | None = None


class Reset(Msg):
    """The master does not know this connection (e.g. it restarted): register again."""

    reason: str = ""


class Dispatch(Msg):
    request_id: str
    attempt: int
    stage: str
    info: RequestInfo
    sampling_params: dict[str, Any]
    inputs: list[str]  # upstream stages whose Data this stage waits for
    routes: list[Route]
    final: bool  # also send Output chunks to the master
    traceparent: str = ""  # W3C trace context of the master's span for this stage attempt ("": not traced)


class Abort(Msg):
    request_id: str
    attempt: int


class Control(Msg):
    call_id: str
    method: str
    args: dict[str, Any] = {}


# stage -> stage (data port)


class Data(Msg):
    """A chunk of an upstream stage's output (eof: that stage is done for this request, no chunk; last: this
    chunk is its last, no eof follows)."""

    request_id: str
    attempt: int
    src: str
    seq: int
    payload: Any = None
    eof: bool = False
    last: bool = False
    # A CFG companion's chunk: the role it ran as (companions.py); "" for the request's own output. One seq
    # numbering covers the request's chunks and its companions' (the order they left the stage in).
    role: Annotated[str, msgspec.Meta(max_length=32, pattern=r"^([a-z0-9_]{1,32})?$")] = ""


Message = Union[
    Register, StageHeartbeat, Output, Done, ControlReply, Deregister,
    RegisterReply, MasterHeartbeat, Reset, Dispatch, Abort, Control, Data,
]

_PAYLOAD_FIELDS = ("payload", "result")

# ---------------------------------------------------------------- encode


_header_encoder = msgspec.msgpack.Encoder()
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> list[Any]:
    """Frames for one message: the encoded message, then its raw buffers (not copied)."""
    frames: list[Any] = [b""]

    def out_of_band(v: Any) -> Any:
        if isinstance(v, Array):
            view = as_bytes_view(v.data)
            if view.nbytes != array_nbytes(v.dtype, tuple(v.shape)):
                raise ValueError(f"array of {v.dtype}{list(v.shape)} has {view.nbytes} bytes")
            frames.append(view)
            return msgspec.msgpack.Ext(EXT_ARRAY, _header_encoder.encode([len(frames) - 1, v.dtype, list(v.shape)]))
        if isinstance(v, CudaIpc):
            return msgspec.msgpack.Ext(EXT_CUDA_IPC, _header_encoder.encode(v))
        if isinstance(v, ShmRef):
            shape = None if v.shape is None else list(v.shape)
            return msgspec.msgpack.Ext(EXT_SHM, _header_encoder.encode([v.name, v.size, v.dtype, shape]))
        if isinstance(v, (bytes, bytearray, memoryview)):
            view = as_bytes_view(v)
            if view.nbytes < INLINE_MAX:
                return v
            frames.append(view)
            return msgspec.msgpack.Ext(EXT_BLOB, _header_encoder.encode([len(frames) - 1]))
        return v

    for field in _PAYLOAD_FIELDS:
        if hasattr(msg, field):
            msg = msgspec.structs.replace(msg, **{field: walk(getattr(msg, field), out_of_band)})
    frames[0] = _encoder.encode(msg)
    return frames


# ---------------------------------------------------------------- decode


_local = threading.local()


def _ext_hook(code: int, data: memoryview) -> Any:
    frames, used = _local.frames, _local.used
    if code == EXT_CUDA_IPC:
        try:
            return _cuda_ipc_decoder.decode(data).check()
        except msgspec.ValidationError as e:
            raise ValueError(f"cuda ipc: {e}") from None
    header = msgspec.msgpack.decode(data)
    if not isinstance(header, list):
        raise ValueError(f"ext {code}: header is not a list")
    if code == EXT_SHM:
        name, size, dtype, shape = header
        if not isinstance(name, str) or not isinstance(size, int) or size < 0:
            raise ValueError("shm reference: bad name or size")
        if dtype is not None:
            shape = tuple(shape)
            if array_nbytes(dtype, shape) != size:
                raise ValueError(f"shm array of {dtype}{list(shape)} does not have {size} bytes")
        return ShmRef(name, size, dtype, shape)
    if code not in (EXT_BLOB, EXT_ARRAY):
        raise ValueError(f"unknown ext code {code}")
    index = header[0]
    if not isinstance(index, int) or not 1 <= index < len(frames) or index in used:
        raise ValueError(f"ext {code}: bad frame index {index!r} ({len(frames) - 1} buffer frames)")
    used.add(index)
    view = as_bytes_view(frames[index])
    if code == EXT_BLOB:
        return view
    _, dtype, shape = header
    shape = tuple(shape)
    if array_nbytes(dtype, shape) != view.nbytes:
        raise ValueError(f"array of {dtype}{list(shape)} does not match its {view.nbytes}-byte frame")
    return Array(dtype, shape, view)


_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook)


def decode(frames: list[Any]) -> Message:
    """The message in frames (bytes, memoryviews or ZMQ frames), or WireError saying why not."""
    if not frames:
        raise WireError("empty message")
    _local.frames, _local.used = frames, set()
    try:
        msg = _decoder.decode(memoryview(frames[0]))
    except Exception as e:  # anything a hostile frame can provoke becomes a rejection
        raise WireError(f"{type(e).__name__}: {e}") from None
    finally:
        used, _local.frames, _local.used = _local.used, None, None
    if len(used) != len(frames) - 1:
        raise WireError(f"{len(frames) - 1 - len(used)} buffer frame(s) not referenced by the message")
    return msg


class _VersionProbe(msgspec.Struct):
    t: str
    protocol_version: int


def peek_register_version(frame: Any) -> int | None:
    """The protocol version of a Register that does not decode as ours (another version's layout)."""
    try:
        probe = msgspec.msgpack.decode(memoryview(frame), type=_VersionProbe)
    except Exception:
        return None
    return probe.protocol_version if probe.t == "Register" else None


def frames_nbytes(frames: list[Any]) -> int:
    """Bytes a message occupies on the wire."""
    return sum(memoryview(f).nbytes for f in frames)


__all__ = [
    "PROTOCOL_VERSION", "WireError", "Array", "ShmRef", "CudaIpc", "RequestInfo", "Route", "Message",
    "Register", "StageHeartbeat", "Output", "Done", "ControlReply", "Deregister",
    "RegisterReply", "MasterHeartbeat", "Reset", "Dispatch", "Abort", "Control", "Data",
    "encode", "decode", "walk", "peek_register_version",
]
