"""The oracle of the vllm-omni tests: vLLM-Omni's own single-process `Omni` engine, all stages in one.

    <vLLM-Omni env python> vllm_omni_oracle.py MODEL DEPLOY.yaml REQUEST.json OUT_DIR

REQUEST.json: {"prompts": [messages, ...], "sampling_params": [per stage],
"speakers": [per prompt: a voice or null; optional]}. A voice goes into the
prompt as vLLM-Omni's serving layer puts it (`additional_information.speaker`,
lower case). The
prompts run one after another, in order (code2wav draws its noise from its
engine's global generator, so a fleet that runs the same requests in the same
order draws the same noise). The chat template is applied with the model's
tokenizer, an image or audio part (as the master decodes it, its raw bytes as
base64 in `data`) rendered as its placeholder and handed to the engine as
`multi_modal_data`, as the vllm-omni engine does for the entry stage. Writes
OUT_DIR/result.json ({"start_s", "requests": [per prompt: the prompt's token
ids, the thinker's expanded prompt and its token ids, the shape of its hidden
states, audio length, sample rate]}), OUT_DIR/thinker_hidden.<i>.f32 and
OUT_DIR/audio.<i>.f32 (float32, row-major).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from pathlib import Path


def prompt_of(tokenizer, messages: list) -> dict:
    import numpy as np
    from PIL import Image

    media: dict[str, list] = {"image": [], "audio": []}
    rendered = []
    for m in messages:
        if isinstance(m["content"], list):
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    raw = base64.b64decode(p["image"]["data"])
                    media["image"].append(Image.fromarray(
                        np.frombuffer(raw, dtype=np.uint8).reshape(p["image"]["shape"]), "RGB"))
                    parts.append({"type": "image"})
                elif p["type"] == "audio":
                    raw = base64.b64decode(p["audio"]["data"])
                    media["audio"].append((np.frombuffer(raw, dtype=np.float32), p["sample_rate"]))
                    parts.append({"type": "audio"})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        rendered.append(m)
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    prompt = {"prompt_token_ids": [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]}
    if media["image"] or media["audio"]:
        prompt["multi_modal_data"] = {k: v if len(v) > 1 else v[0] for k, v in media.items() if v}
    return prompt


def main() -> None:
    model, deploy, request, out = sys.argv[1:5]
    req = json.loads(Path(request).read_text())
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm_omni import Omni

    tokenizer = AutoTokenizer.from_pretrained(model)
    t = time.monotonic()
    omni = Omni(model=model, deploy_config=deploy, stage_init_timeout=600, init_timeout=900)
    result = {"start_s": time.monotonic() - t, "requests": []}
    params = [SamplingParams(**p) for p in req["sampling_params"]]
    speakers = req.get("speakers") or [None] * len(req["prompts"])
    for i, (messages, speaker) in enumerate(zip(req["prompts"], speakers)):
        prompt = prompt_of(tokenizer, messages)
        if speaker:
            prompt["additional_information"] = {"speaker": [speaker.lower().strip()]}
        one = {"prompt_token_ids": prompt["prompt_token_ids"]}
        for o in omni.generate([prompt], params):
            print("oracle output: request", i, "stage", o.stage_id, o.final_output_type, flush=True)
            completion = o.outputs[0] if o.outputs else None
            mm = dict(getattr(o, "multimodal_output", None) or {})
            if completion is not None and isinstance(getattr(completion, "multimodal_output", None), dict):
                mm = {**completion.multimodal_output, **mm}
            if o.final_output_type == "text":
                one["thinker_token_ids"] = [int(x) for x in completion.token_ids]
                one["thinker_prompt_token_ids"] = [int(x) for x in o.prompt_token_ids or []]
                # The thinker's hidden states (prompt + generated tokens but the last), which its output carries
                # because the request goes on to the talker; filed under the stage's output modality (`latent`).
                hidden = next((mm[k] for k in ("latent", "hidden") if k in mm), None)
                if hidden is not None:
                    hidden = torch.cat(list(hidden)) if isinstance(hidden, list) else hidden
                    hidden = hidden.detach().to("cpu").float().contiguous()
                    (Path(out) / f"thinker_hidden.{i}.f32").write_bytes(hidden.numpy().tobytes())
                    one["thinker_hidden_shape"] = list(hidden.shape)
            elif o.final_output_type == "audio":
                audio = mm["audio"]
                audio = torch.cat([a.reshape(-1) for a in audio]) if isinstance(audio, list) else audio.reshape(-1)
                audio = audio.detach().to("cpu").float().contiguous()
                (Path(out) / f"audio.{i}.f32").write_bytes(audio.numpy().tobytes())
                one["audio_samples"] = int(audio.numel())
                sr = mm.get("sr")
                one["sample_rate"] = int(sr.reshape(-1)[0].item()) if hasattr(sr, "reshape") else 24000
        result["requests"].append(one)
    (Path(out) / "result.json").write_text(json.dumps(result))
    print("oracle done", json.dumps(result), flush=True)
    os._exit(0)  # the engine's background threads would otherwise keep the process alive


if __name__ == "__main__":  # the engine spawns its stage processes
    main()
