"""Stage callables and input processors the runtime tests run inside real stage processes.

Gates and markers are files in $OMNIFLEET_TEST_DIR, so a test can order
events across processes without timing anything. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
from pathlib import Path

TEST_DIR = Path(os.environ.get("OMNIFLEET_TEST_DIR", "."))
GATE_WAIT_S = 30.0

# Importing this module is the python engine's "load": count loads per stage process.
if "OMNIFLEET_TEST_DIR" in os.environ:
    with open(TEST_DIR / "loads.log", "a") as _f:
        _f.write(f"{os.environ.get('OMNIFLEET_POD_NAME', '?')} {os.getpid()}\n")


def mark(name: str) -> None:
    (TEST_DIR / name).touch()


async def wait_for(name: str) -> bool:
    path = TEST_DIR / name
    for _ in range(int(GATE_WAIT_S / 0.01)):
        if path.exists():
            return True
        await asyncio.sleep(0.01)
    return False


def prompt_text(inputs) -> str:
    if isinstance(inputs, list):  # chat messages
        return inputs[-1]["content"]
    return inputs


# ---- three-stage chain: upper -> exclaim -> halves (streams two chunks)

def upper(inputs, sampling_params, context):
    return prompt_text(inputs).upper()


async def exclaim(inputs, sampling_params, context):
    return inputs + sampling_params.get("suffix", "!")


# ---- the same chain's next revision (a rollout's answers say which revision served them)

def lower(inputs, sampling_params, context):
    return prompt_text(inputs).lower()


def question(inputs, sampling_params, context):
    return inputs + "?"


def halves(inputs, sampling_params, context):
    n = len(inputs) // 2
    yield inputs[:n]
    yield inputs[n:]


# ---- fan-out / fan-in: source -> (left, right) -> join

def source(inputs, sampling_params, context):
    return prompt_text(inputs)


def describe(inputs, sampling_params, context):
    return {"stage": context.stage, "text": inputs, "params": sampling_params}


def join_inputs(upstream, request):
    """Input processor of the join stage (whole mode: each value is the list of chunks)."""
    return {name: chunks[0] for name, chunks in sorted(upstream.items())}


def tag_source(inputs, sampling_params, context):
    """Stream mode, several inputs, no input processor: each call gets {upstream: chunk}."""
    assert isinstance(inputs, dict) and len(inputs) == 1, inputs
    ((name, chunk),) = inputs.items()
    return f"{name}={chunk['text']}"


def render(inputs, sampling_params, context):
    return json.dumps(inputs, sort_keys=True)


# ---- streaming between stages: a slow source, a per-chunk consumer

async def slow_source(inputs, sampling_params, context):
    yield "first"
    await wait_for("go")
    yield "second"
    mark("upstream-done")


async def bracket(inputs, sampling_params, context):
    yield f"<{inputs}>"


# ---- co-location: a large payload to the stage in the same pod

PAYLOAD_SIZE = 1 << 20


def blob(inputs, sampling_params, context):
    return {"pod": context.replica, "blob": bytes(range(256)) * (PAYLOAD_SIZE // 256)}


def blob_info(inputs, sampling_params, context):
    data = inputs["blob"]
    intact = bytes(data) == bytes(range(256)) * (PAYLOAD_SIZE // 256)
    return f"{inputs['pod']}->{context.replica}:{len(data)}:{type(data).__name__}:{intact}"


# ---- failures: gated stages

async def first_then_gate(inputs, sampling_params, context):
    """Stream a first chunk naming the replica, then wait for the gate before the rest."""
    yield f"[{context.replica}]"
    await wait_for("gate")
    yield "done"


async def gated_entry(inputs, sampling_params, context):
    mark(f"started-{context.request_id}-{context.replica}")
    await wait_for("gate")
    return f"{prompt_text(inputs)}@{context.replica}"


async def abortable(inputs, sampling_params, context):
    try:
        yield "tick"
        await wait_for("gate")
        yield "tock"
    except (asyncio.CancelledError, GeneratorExit):
        mark(f"aborted-{context.stage}")
        raise


async def held_upper(inputs, sampling_params, context):
    """Upper-cases; a prompt starting "hold" first notes its start and waits for the gate (noting an abort):
    requests held on each of several masters (test_ha.py)."""
    text = prompt_text(inputs)
    if text.startswith("hold"):
        mark(f"held-{text}")
        try:
            await wait_for("gate")
        except asyncio.CancelledError:
            mark(f"aborted-{text}")
            raise
    return text.upper()


def echo(inputs, sampling_params, context):
    return inputs


async def flood(inputs, sampling_params, context):
    """As many tiny chunks as asked for, as fast as the stage can send them (no await between them)."""
    mark("flooding")
    for i in range(int(sampling_params["chunks"])):
        yield f"{i},"


async def omnifleet_control(method, args):
    """Control hook of this module's stages."""
    if method == "whoami":
        return {"pod": os.environ.get("OMNIFLEET_POD_NAME"), "pid": os.getpid(), "args": args}
    if method == "wait_gate":
        mark(f"control-waiting-{os.environ.get('OMNIFLEET_POD_NAME')}")
        return await wait_for("gate")
    raise ValueError(f"unsupported control method {method!r}")


# ---- engine kinds (run in-process by test_engines.py)

def kind_plain(inputs, sampling_params, context):
    return None if inputs == "skip" else f"plain:{inputs}:{context.chunk_index}"


def kind_gen(inputs, sampling_params, context):
    context.state["n"] = context.state.get("n", 0) + 1
    yield f"gen:{inputs}"
    yield None  # emits nothing
    yield f"seen:{context.state['n']}"


async def kind_async(inputs, sampling_params, context):
    await asyncio.sleep(0)
    return {"async": inputs, "params": sampling_params}


async def kind_agen(inputs, sampling_params, context):
    for ch in inputs:
        yield ch


# ---- shared-memory hygiene: a processor that fails part-way through a co-located stream

SHM_CHUNKS = 10
_seen_chunks: dict[str, int] = {}


async def shm_chunks(inputs, sampling_params, context):
    """Ten chunks big enough to travel through shared memory to a co-located stage, back to back."""
    for i in range(SHM_CHUNKS):
        yield {"i": i, "blob": bytes([i]) * (256 * 1024)}


def fail_on_second_chunk(upstream, request):
    n = _seen_chunks[request.request_id] = _seen_chunks.get(request.request_id, 0) + 1
    if n == 2:
        raise ValueError("chunk 2 is not to my liking")
    return upstream["src"]["i"]


# ---- the HTTP API under attack (test_api_security.py)

WEDGE_S = 25.0  # longer than the heartbeat timeout, so the master drops the replica meanwhile


async def wedge_on_request(inputs, sampling_params, context):
    """Blocks its own event loop (time.sleep in a coroutine) when the prompt says "wedge"; notes each prompt."""
    text = prompt_text(inputs)
    with open(TEST_DIR / f"seen-{context.replica}", "a") as f:
        f.write(text + "\n")
    if "wedge" in text:
        time.sleep(WEDGE_S)
    return f"{text}@{context.replica}"


async def until_aborted(inputs, sampling_params, context):
    """Waits for the gate; notes its cancellation (an Abort from the master)."""
    try:
        await wait_for("gate")
        return "gate"
    except asyncio.CancelledError:
        mark(f"cancelled-{context.request_id}")
        raise


def any_json(inputs, sampling_params, context):
    """Whatever JSON the API let through, as short text; never fails on its input."""
    return json.dumps(inputs, default=repr)[:200]


def tiny_image(inputs, sampling_params, context):
    from omnifleet_runtime.wire import Array

    return {"images": Array("uint8", (1, 2, 3, 3), bytes(range(18)))}


def tiny_audio(inputs, sampling_params, context):
    from omnifleet_runtime.wire import Array

    return {"audio": Array("float32", (64,), bytes(256)), "sample_rate": 16000}


def picky(inputs, sampling_params, context):
    """Refuses the prompt "bad" as the request's fault (400), fails on "boom" as its own (500)."""
    from omnifleet_runtime.engines import BadInput

    text = prompt_text(inputs)
    if text == "bad":
        raise BadInput("this stage takes no 'bad' prompt")
    if text == "boom":
        raise RuntimeError("the stage broke")
    return text


# ---- metrics: an audio stage (a second of silence-free tone per request, in two chunks)

TONE_RATE = 8000


def tone(inputs, sampling_params, context):
    import struct

    from omnifleet_runtime.wire import Array

    for _ in range(2):
        samples = [0.25] * (TONE_RATE // 2)
        yield {"audio": Array("float32", (len(samples),), struct.pack(f"<{len(samples)}f", *samples)),
               "sample_rate": TONE_RATE}


# ---- chat media: what the entry stage (and the next one) got of image and audio parts

def _media_summary(messages):
    out = []
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                img = part["image"]
                out.append({"type": "image", "shape": img["shape"], "dtype": img["dtype"],
                            "first_pixel": list(img["data"][:3]) if img["data"] is not None else None})
            elif part["type"] == "audio":
                a = part["audio"]
                first = struct.unpack("<f", a["data"][:4])[0] if a["data"] is not None else None
                out.append({"type": "audio", "shape": a["shape"], "sample_rate": part["sample_rate"],
                            "first_sample": first,
                            "bytes": len(a["data"]) if a["data"] is not None else None})
            elif part["type"] == "video" and "file" in part:
                out.append({"type": "video", "file": len(part["file"]) if part["file"] is not None else None})
            elif part["type"] == "video":
                v = part["video"]
                out.append({"type": "video", "shape": v["shape"], "dtype": v["dtype"], "fps": part["fps"],
                            "total_frames": part["total_frames"], "frame_indices": part["frame_indices"],
                            "bytes": len(v["data"]) if v["data"] is not None else None})
            else:
                out.append({"type": part["type"]})
    return out


def media_entry(inputs, sampling_params, context):
    return {"entry": _media_summary(inputs)}


def media_next(inputs, sampling_params, context):
    return json.dumps({**inputs, "next": _media_summary(context.request.messages)})


def hear(inputs, sampling_params, context):
    """A stand-in transcriber: what it heard (the audio part the master decoded) and what it was asked, in two
    chunks (a streaming text stage)."""
    parts = [p for m in inputs for p in (m["content"] if isinstance(m["content"], list) else [])]
    audio = next(p for p in parts if p["type"] == "audio")
    asked = next(p["text"] for p in parts if p["type"] == "text")
    first = struct.unpack("<f", audio["audio"]["data"][:4])[0]
    yield f"{audio['audio']['shape'][0]} samples at {audio['sample_rate']} Hz, first {first:g}"
    yield f" | {asked} | temperature {sampling_params.get('temperature')}"


# ---- striped data: large chunks split over several connections, small ones in between

STRIPED_SIZES = (24 << 20, 100, 12 << 20, 7, 9 << 20)


def _pattern(i: int, n: int) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(251)) * (n // 251) + bytes(n % 251)


async def striped_source(inputs, sampling_params, context):
    for i, n in enumerate(STRIPED_SIZES):
        yield {"i": i, "blob": _pattern(i, n)}


def striped_check(inputs, sampling_params, context):
    """Per chunk (stream mode), in the order applied: its index and whether its bytes are exactly the sender's."""
    data = inputs["blob"]
    return f"{inputs['i']}:{len(data)}:{bytes(data) == _pattern(inputs['i'], len(data))};"


# ---- usage: stages that report tokens the way llm stages do (token_ids, prompt_token_ids)

def counted_entry(inputs, sampling_params, context):
    words = prompt_text(inputs).split()
    return {"text": " ".join(words), "prompt_token_ids": list(range(len(words))), "token_ids": [7] * (2 * len(words))}


async def counted_final(inputs, sampling_params, context):
    for i in range(3):
        yield {"text": f"t{i}", "token_ids": [i, i]}


# ---- CFG companions (promptExpand): a source whose runs say who they are, a join that sees them all

def cfg_source(inputs, sampling_params, context):
    """Two chunks per run: the run's id, replica and process, then its prompt and params."""
    text = prompt_text(inputs)
    if text == "refuse me":
        from omnifleet_runtime.engines import BadInput

        raise BadInput("cannot take 'refuse me'")
    yield {"rid": context.request_id, "replica": context.replica, "pid": os.getpid()}
    yield {"text": text, "params": sampling_params}


async def cfg_held(inputs, sampling_params, context):
    """A run whose prompt is "hold" waits for the gate; an abort is noted per run id."""
    try:
        yield {"rid": context.request_id}
        if prompt_text(inputs) == "hold":
            await wait_for("gate")
        yield {"text": prompt_text(inputs)}
    except (asyncio.CancelledError, GeneratorExit):
        mark(f"aborted-{context.request_id}")
        raise


def expand_two(item, sampling_params, request):
    return [{"role": "negative", "input": request.extra.get("negative_prompt", "")},
            {"role": "plain", "input": "plain " + prompt_text(item), "sampling_params": {"k": 2}}]


def cfg_join(upstream, request):
    """Whole mode: every input (the request's and its companions') as {name: its chunks merged}."""
    out = {}
    for name, chunks in upstream.items():
        merged = {}
        for c in chunks:
            merged.update(c)
        out[name] = merged
    return out


def cfg_tags(inputs, sampling_params, context):
    """Stream mode, no input processor: the request's chunks come bare, a companion's as {stage:role: chunk}."""
    if isinstance(inputs, dict) and len(inputs) == 1 and ":" in next(iter(inputs)):
        ((name, chunk),) = inputs.items()
        return f"[{name}]" + ",".join(sorted(chunk))
    return "[own]" + ",".join(sorted(inputs))
