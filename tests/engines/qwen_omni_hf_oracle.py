"""The oracle of test_qwen_omni_stock: transformers' one-process Qwen2.5-Omni generate (thinker, talker and
Token2Wav in one call), greedy thinker and talker, the global generator seeded just before.

    python qwen_omni_hf_oracle.py MODEL REQUEST.json OUT_DIR

REQUEST.json: {"prompt_token_ids", "thinker_max_new_tokens", "thinker_repetition_penalty", "talker_max_new_tokens",
"speaker", "seed"}.
Writes OUT_DIR/result.json ({"token_ids", "codes", "audio_samples", "hidden_shape"}; codes are what the
talker handed Token2Wav, read by wrapping its generate), OUT_DIR/audio.f32 (float32 samples) and
OUT_DIR/hidden.f32 (the thinker's last hidden states, after its final norm, at the prompt's and the generated
tokens' positions but the last: what the talker is given).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import Qwen2_5OmniForConditionalGeneration


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
    ids = torch.tensor([request["prompt_token_ids"]])
    torch.manual_seed(request["seed"])  # greedy thinker and talker draw nothing: Token2Wav's noise is the first draw
    with torch.inference_mode():
        seq, wav = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker=request["speaker"],
                              thinker_max_new_tokens=request["thinker_max_new_tokens"], thinker_do_sample=False,
                              thinker_eos_token_id=151645,
                              thinker_repetition_penalty=request["thinker_repetition_penalty"],
                              talker_do_sample=False, talker_max_new_tokens=request["talker_max_new_tokens"])
    [(codes, offset)] = talker_out
    codes = codes[0, offset:]
    stop = ((codes == 8292) | (codes == 8294)).nonzero()
    codes = codes[: int(stop[0]) if len(stop) else len(codes)]
    with torch.inference_mode():
        hidden = m.thinker.model(input_ids=seq[:, :-1]).last_hidden_state[0].float().contiguous()
    wav = wav.reshape(-1).float().contiguous()
    (out / "audio.f32").write_bytes(wav.numpy().tobytes())
    (out / "hidden.f32").write_bytes(hidden.numpy().tobytes())
    (out / "result.json").write_text(json.dumps({
        "token_ids": seq[0, ids.shape[1]:].tolist(), "codes": codes.tolist(), "audio_samples": int(wav.numel()),
        "hidden_shape": list(hidden.shape)}))


if __name__ == "__main__":
    main()
