"""The oracle of test_qwen_omni_stock: transformers' one-process Qwen2.5-Omni generate (thinker, talker and
Token2Wav in one call), greedy thinker and talker, the global generator seeded just before.

    python qwen_omni_hf_oracle.py MODEL REQUEST.json OUT_DIR

REQUEST.json: {"prompt_token_ids", "thinker_max_new_tokens", "thinker_repetition_penalty", "talker_max_new_tokens",
"speaker", "seed"}, or in place of "prompt_token_ids" "messages": a chat whose parts are `text`, and `image`
(uint8 RGB pixels) and `audio` (float32 samples) as the master decodes them, the prompt then made by the
checkpoint's own processor (its chat template, placeholders expanded by the media's grids and lengths).
Writes OUT_DIR/result.json ({"prompt_token_ids", "token_ids", "codes", "audio_samples", "hidden_shape"}; codes
are what the talker handed Token2Wav, read by wrapping its generate), OUT_DIR/audio.f32 (float32 samples) and,
for a prompt of token ids, OUT_DIR/hidden.f32 (the thinker's last hidden states, after its final norm, at the
prompt's and the generated tokens' positions but the last: what the talker is given).
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor


def chat_inputs(model: str, messages: list[dict]) -> dict:
    """The processor's inputs for a chat of text, image and audio parts (one user turn's media)."""
    from PIL import Image

    raw = lambda part: base64.b64decode(part["data"])  # noqa: E731
    images, audios, turns = [], [], []
    for msg in messages:
        content = []
        for part in msg["content"]:
            if part["type"] == "image":
                a = part["image"]
                images.append(Image.fromarray(np.frombuffer(raw(a), np.uint8).reshape(a["shape"]), "RGB"))
            elif part["type"] == "audio":
                assert part["sample_rate"] == 16000, "the feature extractor's rate: no resampling here"
                audios.append(np.frombuffer(raw(part["audio"]), np.float32))
            content.append({"type": part["type"], **({"text": part["text"]} if part["type"] == "text" else {})})
        turns.append({"role": msg["role"], "content": content})
    processor = Qwen2_5OmniProcessor.from_pretrained(model)
    text = processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    inputs = dict(processor(text=[text], images=images or None, audio=audios or None, return_tensors="pt"))
    if "pixel_values" in inputs:  # generate hands unprefixed inputs to the talker too, which refuses pixels
        inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
    return inputs


def main() -> None:
    model, request, out = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    m = Qwen2_5OmniForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    talker_out = []
    generate = m.talker.generate

    def recorded(*args, **kwargs):
        result = generate(*args, **kwargs)
        talker_out.append((result, kwargs["input_ids"].shape[1]))
        return result

    m.talker.generate = recorded
    if "messages" in request:
        inputs = chat_inputs(model, request["messages"])
    else:
        ids = torch.tensor([request["prompt_token_ids"]])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ids = inputs["input_ids"]
    torch.manual_seed(request["seed"])  # greedy thinker and talker draw nothing: Token2Wav's noise is the first draw
    with torch.inference_mode():
        seq, wav = m.generate(**inputs, speaker=request["speaker"],
                              thinker_max_new_tokens=request["thinker_max_new_tokens"], thinker_do_sample=False,
                              thinker_eos_token_id=151645,
                              thinker_repetition_penalty=request["thinker_repetition_penalty"],
                              talker_do_sample=False, talker_max_new_tokens=request["talker_max_new_tokens"])
    [(codes, offset)] = talker_out
    codes = codes[0, offset:]
    stop = ((codes == 8292) | (codes == 8294)).nonzero()
    codes = codes[: int(stop[0]) if len(stop) else len(codes)]
    hidden = None
    if "messages" not in request:
        with torch.inference_mode():
            hidden = m.thinker.model(input_ids=seq[:, :-1]).last_hidden_state[0].float().contiguous()
        (out / "hidden.f32").write_bytes(hidden.numpy().tobytes())
    wav = wav.reshape(-1).float().contiguous()
    (out / "audio.f32").write_bytes(wav.numpy().tobytes())
    (out / "result.json").write_text(json.dumps({
        "prompt_token_ids": ids[0].tolist(), "token_ids": seq[0, ids.shape[1]:].tolist(), "codes": codes.tolist(),
        "audio_samples": int(wav.numel()), "hidden_shape": None if hidden is None else list(hidden.shape)}))


if __name__ == "__main__":
    main()
