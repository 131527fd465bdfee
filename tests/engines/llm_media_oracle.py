"""The oracle of test_llm_media: vLLM's own `LLM.chat`, given the chat messages as a client sends them.

    python llm_media_oracle.py MODEL REQUEST.json OUT.json

REQUEST.json: {"engine": engine args, "messages": [...], "sampling_params": {...}}. vLLM decodes the
content parts itself (a PNG data URL, a base64 WAV), renders the chat template with its own
placeholders and expands them; nothing of omnifleet is on the path. Writes OUT.json: the prompt's
token ids as the engine ran it and the generated token ids.
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
    [o] = llm.chat(req["messages"], SamplingParams(**req["sampling_params"]),
                   chat_template_content_format="openai")
    Path(out).write_text(json.dumps({"prompt_token_ids": list(o.prompt_token_ids),
                                     "token_ids": list(o.outputs[0].token_ids)}))
    print("oracle done", flush=True)
    os._exit(0)  # the engine's background threads would otherwise keep the process alive


if __name__ == "__main__":
    main()
