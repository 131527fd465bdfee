"""One `vllm-omni` stage's engine on its own, for the vllm-omni tests: what the stage puts on the wire.

    <vLLM-Omni env python> vllm_omni_stage_probe.py PIPELINE.json STAGE REQUEST.json OUT_DIR

Starts omnifleet's `VllmOmniEngine` for STAGE of the OmniPipeline document
PIPELINE.json (an entry stage), runs REQUEST.json's requests one after another
({"prompts": [messages, ...]}; an image or audio part as the master decodes it,
its raw bytes as base64 in `data`)
with the stage's sampling params and writes what the stage would send
downstream: OUT_DIR/chunk.<i>.json (token ids, prompt token ids, finish reason and,
per wire array of `extra`, its dtype and shape) and OUT_DIR/extra.<i>.<key>.bin
(each array's raw bytes).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path


def raw(part: dict) -> dict:
    """A media part of REQUEST.json with its bytes as the stage receives them."""
    import base64

    kind = part.get("type")
    if kind in ("image", "audio"):
        return {**part, kind: {**part[kind], "data": base64.b64decode(part[kind]["data"])}}
    return part


async def probe(doc: dict, stage_name: str, prompts: list, out: Path) -> None:
    from omnifleet_runtime.engines.base import EngineRequest
    from omnifleet_runtime.engines.vllm_omni import VllmOmniEngine
    from omnifleet_runtime.schema import OmniPipeline
    from omnifleet_runtime.validate import resolve
    from omnifleet_runtime.wire import Array, RequestInfo

    pipeline = resolve(OmniPipeline.model_validate(doc))
    stage = next(s for s in pipeline.spec.stages if s.name == stage_name)
    engine = VllmOmniEngine(stage, f"{stage_name}-probe")
    await engine.start()
    for i, messages in enumerate(prompts):
        async def inputs(messages=messages):
            yield [{**m, "content": [raw(p) for p in m["content"]]} if isinstance(m["content"], list) else m
                   for m in messages]

        request = EngineRequest(request_id=f"probe-{i}", inputs=inputs(), sampling_params=dict(stage.sampling_params),
                                info=RequestInfo(request_id=f"probe-{i}", kind="chat", model=pipeline.metadata.name))
        chunks = [c async for c in engine.generate(request)]
        assert len(chunks) == 1, chunks
        chunk = chunks[0]
        extra = {}
        for key, value in chunk["extra"].items():
            assert isinstance(value, Array), (key, type(value))
            extra[key] = {"dtype": value.dtype, "shape": list(value.shape)}
            (out / f"extra.{i}.{key}.bin").write_bytes(bytes(value.data))
        (out / f"chunk.{i}.json").write_text(json.dumps({
            "token_ids": chunk["token_ids"], "prompt_token_ids": chunk["prompt_token_ids"],
            "finish_reason": chunk["finish_reason"], "extra": extra}))
        print("probe done", i, json.dumps(extra), flush=True)


def main() -> None:
    doc_path, stage_name, request_path, out = sys.argv[1:5]
    asyncio.run(probe(json.loads(Path(doc_path).read_text()), stage_name,
                      json.loads(Path(request_path).read_text())["prompts"], Path(out)))
    os._exit(0)  # the engine's background threads would otherwise keep the process alive


if __name__ == "__main__":  # the engine spawns its stage processes
    main()
