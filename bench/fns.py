"""Stage callables of the benchmarks, run inside real stage processes (`bench.fns:NAME`).

Light on purpose (standard library only): every stage process imports it.
Timestamps are time.monotonic(), which on Linux is CLOCK_MONOTONIC, one clock
for every process of the machine, so a stamp taken in the producer process
can be subtracted from one taken in the consumer process.
"""

from __future__ import annotations

import hashlib
import json
import time

PAGE = 4096


# ---- per-hop overhead: stages that return their input


def noop(inputs, sampling_params, context):
    """A plain callable (the runtime runs it in a worker thread)."""
    return inputs


async def anoop(inputs, sampling_params, context):
    """The same as a coroutine (the runtime awaits it on the stage's event loop: no thread hop)."""
    return inputs


# ---- bulk transfer: a producer of N bytes, a consumer returning a small digest

_BUFFERS: dict[int, bytes] = {}


def _buffer(n: int) -> bytes:
    buf = _BUFFERS.get(n)
    if buf is None:
        _BUFFERS.clear()  # one size at a time: bounded memory
        buf = _BUFFERS[n] = b"\x5a" * n  # written once, so its pages are resident
    return buf


def produce(inputs, sampling_params, context):
    """inputs: the prompt, JSON {"n": bytes, "chunk": 0 or frame size, "hold": seconds (optional)}.

    Returns {"t0": stamp, "data": N bytes} (one buffer, or a list of `chunk`-sized views of it).
    The buffer is made once per size, so the request measures the boundary, not the allocation.
    `hold` keeps the request that long first (a small request that lasts as long as a big one).
    """
    spec = json.loads(inputs)
    n, chunk = int(spec["n"]), int(spec.get("chunk") or 0)
    if spec.get("hold"):
        time.sleep(float(spec["hold"]))
    buf = _buffer(n)
    if chunk:
        view = memoryview(buf)
        data = [view[i:i + chunk] for i in range(0, n, chunk)]
    else:
        data = buf
    return {"t0": time.monotonic(), "data": data}


def touch(parts) -> tuple[int, str]:
    """Read one byte of every page (what any consumer pays to get the bytes into its memory); a digest."""
    h = hashlib.blake2b(digest_size=8)
    n = 0
    for p in parts:
        v = memoryview(p)
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")
        h.update(v[::PAGE].tobytes())
        n += v.nbytes
    return n, h.hexdigest()


def consume(inputs, sampling_params, context):
    """Touch every page of the producer's bytes; return the digest and the stamps, as JSON text."""
    t_in = time.monotonic()
    data = inputs["data"]
    n, digest = touch(data if isinstance(data, list) else [data])
    t1 = time.monotonic()
    return json.dumps({"n": n, "t0": inputs["t0"], "t_in": t_in, "t1": t1, "digest": digest,
                       "type": type(data).__name__})


# ---- time to first audio: a streaming vocoder stand-in

_RATE = 24000
_TEN_MS = b"\x00\x00\x00\x00" * (_RATE // 100)  # 10 ms of float32 silence


def vocode(inputs, sampling_params, context):
    """One upstream chunk (a thinker's token delta) in, 10 ms of 24 kHz audio out at once: a vocoder that
    costs nothing, so the time to first audio is the pipeline's, not the vocoder's."""
    from omnifleet_runtime.wire import Array

    return {"audio": Array("float32", (_RATE // 100,), _TEN_MS), "sample_rate": _RATE}
