"""A tiny seeded random Qwen2.5-Omni checkpoint (thinker, talker, code2wav) for the vllm-omni tests.

    <vllm-omni env python> -m omnifleet_runtime.devsetup.tiny_omni [--print-path]

Run with the python that will load it: vLLM-Omni's environment
(devsetup.vllm_omni_env) for the vllm-omni tests, the main one for stock
vLLM's thinker (test_llm_media); the checkpoint is written by that
environment's transformers, so its config reads back exactly. Its multimodal
processor is saved when torchvision loads there (both environments have it).
Location: ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/models/tiny-qwen2.5-omni-<key>/,
<key> hashing the recipe below and the transformers version; complete when its
stamp exists (built in a temporary folder, renamed into place: `cached`).

What vLLM-Omni needs beyond transformers' defaults: a byte-level tokenizer that
keeps Qwen's special tokens at their real ids (the thinker's config names them),
head_dim 64 (vLLM's CPU attention), mrope sections that sum to head_dim/2, and a
`spk_dict.pt` with the two speakers the talker knows (code2wav always loads it; transformers' talker
reads each one's text token too), and the thinker's input and output embeddings untied, as in the real
checkpoint (with the config saying tied, transformers kept them apart and vLLM tied them: the two
answered different tokens).
Weights: transformers' initialisers under torch.manual_seed, stored as bfloat16
(engines load them as float32; code2wav fails in bfloat16).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

STAMP = ".omnifleet-complete"
SEED = 20261201
H = 128
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]}
SPECIALS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|AUDIO|>": 151646,
    "<|audio_bos|>": 151647, "<|audio_eos|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_bos|>": 151652, "<|vision_eos|>": 151653, "<|vision_pad|>": 151654,
    "<|IMAGE|>": 151655, "<|VIDEO|>": 151656,
}
# Qwen2.5-Omni's own template, less its default system prompt: an image, audio or video content part renders
# as its placeholder between its bos/eos tokens (vLLM's processor expands the placeholder to the media's length).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RECIPE = {
    "seed": SEED,
    "text": dict(vocab_size=151936, hidden_size=H, intermediate_size=256, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                 rope_parameters=ROPE, tie_word_embeddings=False),
    "audio": dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=256, d_model=128,
                  output_dim=H, n_window=100, max_source_positions=1500),
    "vision": dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=H,
                   fullatt_block_indexes=[0], window_size=112, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2),
    # The thinker's config names Qwen's special tokens (vLLM-Omni's mrope positions read them).
    "thinker_ids": dict(audio_token_index=151646, image_token_index=151655, video_token_index=151656,
                        audio_start_token_id=151647, audio_end_token_id=151648, vision_start_token_id=151652,
                        vision_end_token_id=151653, seconds_per_chunk=2, position_id_per_seconds=25),
    "talker": dict(vocab_size=8448, embedding_size=H, hidden_size=H, intermediate_size=256, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                   rope_parameters=ROPE, spatial_merge_size=2),
    "dit": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, head_dim=64, ff_mult=2, emb_dim=64,
                look_ahead_layers=[1], look_backward_layers=[0], repeats=2, num_embeds=8193, mel_dim=80,
                enc_emb_dim=32, enc_dim=32, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                enc_se_channels=16),
    "bigvgan": dict(mel_dim=80, upsample_initial_channel=64),
    # Each speaker's text token (the talker's first text input, transformers' `bos_token` of the speaker).
    "speakers": {"Chelsie": 151870, "Ethan": 151871},
    "specials": SPECIALS,
    "chat_template": CHAT_TEMPLATE,
}
_t0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[tiny_omni {time.monotonic() - _t0:5.1f}s] {msg}", flush=True)


def model_dir(name: str = "tiny-qwen2.5-omni", recipe: dict | None = None) -> Path:
    """Where a checkpoint of this recipe and this transformers version lives."""
    import transformers

    key = hashlib.sha256(json.dumps([recipe or RECIPE, transformers.__version__],
                                    sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")
    return root / "models" / f"{name}-{key}"


def byte_tokenizer(specials: dict[str, int], chat_template: str, words: dict[str, int] | None = None,
                   **named: str) -> Any:
    """A byte-level tokenizer (256 byte tokens) with a model's special tokens, and any words, at their real ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(specials)
    vocab.update(words or {})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if words:
        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=named)
    fast.chat_template = chat_template
    return fast


def build(out: Path) -> None:
    import importlib.util

    import torch
    from transformers import (Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor)

    log("tokenizer: 256 byte tokens + Qwen's special tokens at their ids")
    fast = byte_tokenizer(SPECIALS, CHAT_TEMPLATE, image_token="<|IMAGE|>", audio_token="<|AUDIO|>",
                          video_token="<|VIDEO|>", vision_bos_token="<|vision_bos|>",
                          vision_eos_token="<|vision_eos|>", audio_bos_token="<|audio_bos|>",
                          audio_eos_token="<|audio_eos|>")

    log("Qwen2_5OmniForConditionalGeneration with seeded weights")
    cfg = Qwen2_5OmniConfig(
        thinker_config=dict(text_config=RECIPE["text"], audio_config=RECIPE["audio"], vision_config=RECIPE["vision"],
                            **RECIPE["thinker_ids"]),
        talker_config=RECIPE["talker"],
        token2wav_config=dict(dit_config=RECIPE["dit"], bigvgan_config=RECIPE["bigvgan"]),
        enable_audio_output=True)
    cfg.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    # The multimodal processor (image/audio input) needs torchvision: text-only checkpoints without it.
    if importlib.util.find_spec("torchvision") is not None:
        Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=Qwen2VLVideoProcessor(),
                             feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=fast,
                             chat_template=CHAT_TEMPLATE).save_pretrained(out)
    else:
        log("no torchvision: no multimodal processor (the checkpoint takes text input)")
    # code2wav reads the speakers' conditioning and reference mel from here, transformers' talker the bos_token.
    g = torch.Generator().manual_seed(SEED)
    dit = RECIPE["dit"]
    torch.save({name: {"cond": torch.randn(1, dit["enc_emb_dim"], generator=g),
                       "ref_mel": torch.randn(1, 300, dit["mel_dim"], generator=g), "bos_token": bos}
                for name, bos in RECIPE["speakers"].items()}, out / "spk_dict.pt")


def cached(final: Path, recipe: dict, make: Callable[[Path], None], complete: Callable[[Path], bool] | None = None
           ) -> Path:
    """`final`, made by `make` if it is not complete (built in a temporary folder beside it, stamped with the
    recipe, renamed into place: a build cut short leaves nothing that looks complete)."""
    if (final / STAMP).exists() and (complete is None or complete(final)):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        make(tmp)
        (tmp / STAMP).write_text(json.dumps(recipe, sort_keys=True) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built {final}")
    return final


def ensure() -> Path:
    """The checkpoint's directory, built if missing."""
    import importlib.util

    # A copy built where torchvision was missing lacks the processor: build it again where it is not.
    return cached(model_dir(), RECIPE, build, lambda final: (final / "processor_config.json").exists()
                  or importlib.util.find_spec("torchvision") is None)


def cli(ensure: Callable[[], Path], doc: str, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--print-path", action="store_true", help="print only the checkpoint's directory")
    args = ap.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr if args.print_path else sys.stdout):
        path = ensure()
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(ensure, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
