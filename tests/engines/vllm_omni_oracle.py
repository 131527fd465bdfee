"""The oracle of the vllm-omni tests: vLLM-Omni's own single-process `Omni` engine, all stages in one.

    <vLLM-Omni env python> vllm_omni_oracle.py MODEL DEPLOY.yaml REQUEST.json OUT_DIR

REQUEST.json: {"messages": [...], "sampling_params": [per stage]}. The chat
template is applied with the model's tokenizer (as the vllm-omni engine does
for the entry stage). Writes OUT_DIR/result.json (thinker token ids, the
shape of its hidden states, audio length, sample rate), OUT_DIR/thinker_hidden.f32
and OUT_DIR/audio.f32 (float32, row-major).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    model, deploy, request, out = sys.argv[1:5]
    req = json.loads(Path(request).read_text())
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm_omni import Omni

    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
        req["messages"], add_generation_prompt=True, tokenize=True)
    ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]  # a BatchEncoding in transformers 5
    t = time.monotonic()
    omni = Omni(model=model, deploy_config=deploy, stage_init_timeout=600, init_timeout=900)
    start_s = time.monotonic() - t
    outs = omni.generate([{"prompt_token_ids": ids}], [SamplingParams(**p) for p in req["sampling_params"]])
    result = {"prompt_token_ids": ids, "start_s": start_s}
    for o in outs:
        print("oracle output: stage", o.stage_id, o.final_output_type, flush=True)
        completion = o.outputs[0] if o.outputs else None
        mm = dict(getattr(o, "multimodal_output", None) or {})
        if completion is not None and isinstance(getattr(completion, "multimodal_output", None), dict):
            mm = {**completion.multimodal_output, **mm}
        if o.final_output_type == "text":
            result["thinker_token_ids"] = [int(x) for x in completion.token_ids]
            # The thinker's hidden states (prompt + generated tokens but the last), which its output carries
            # because the request goes on to the talker; filed under the stage's output modality (`latent`).
            hidden = next((mm[k] for k in ("latent", "hidden") if k in mm), None)
            if hidden is not None:
                import torch

                hidden = torch.cat(list(hidden)) if isinstance(hidden, list) else hidden
                hidden = hidden.detach().to("cpu").float().contiguous()
                (Path(out) / "thinker_hidden.f32").write_bytes(hidden.numpy().tobytes())
                result["thinker_hidden_shape"] = list(hidden.shape)
        elif o.final_output_type == "audio":
            import torch

            audio = mm["audio"]
            audio = torch.cat([a.reshape(-1) for a in audio]) if isinstance(audio, list) else audio.reshape(-1)
            audio = audio.detach().to("cpu").float().contiguous()
            (Path(out) / "audio.f32").write_bytes(audio.numpy().tobytes())
            result["audio_samples"] = int(audio.numel())
            sr = mm.get("sr")
            result["sample_rate"] = int(sr.reshape(-1)[0].item()) if hasattr(sr, "reshape") else 24000
    (Path(out) / "result.json").write_text(json.dumps(result))
    print("oracle done", json.dumps(result), flush=True)
    os._exit(0)  # the engine's background threads would otherwise keep the process alive


if __name__ == "__main__":  # the engine spawns its stage processes
    main()
