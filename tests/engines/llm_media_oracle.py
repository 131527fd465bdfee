"""The oracle of test_llm_media: vLLM's own `LLM.chat`, given the chat messages as a client sends them.

    python llm_media_oracle.py MODEL REQUEST.json OUT.json

REQUEST.json: {"engine": engine args, "requests": [messages, ...], "sampling_params": {...}}. vLLM
decodes the content parts itself (a PNG data URL, a base64 WAV, an MP4 data URL with its own video
loader), renders the chat template with its own placeholders and expands them; nothing of omnifleet is
on the path. Writes OUT.json: per request, in order, the prompt's token ids as the engine ran it and the
generated token ids and text.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    model, request, out = sys.argv[1:4]
    req = json.loads(Path(request).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **req["engine"])
    results = []
    for messages in req["requests"]:  # one at a time, as the fleet runs them
        [o] = llm.chat(messages, SamplingParams(**req["sampling_params"]), chat_template_content_format="openai")
        results.append({"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                        "text": o.outputs[0].text})
    Path(out).write_text(json.dumps(results))
    print("oracle done", flush=True)
    os._exit(0)  # the engine's background threads would otherwise keep the process alive


if __name__ == "__main__":
    main()
