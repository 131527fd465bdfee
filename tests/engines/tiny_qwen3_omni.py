"""A tiny seeded random Qwen3-Omni (MoE thinker, MoE talker with its code predictor, code2wav) for the tests.

    <vLLM-Omni env python> tiny_qwen3_omni.py [--print-path]

Run with vLLM-Omni's python (its transformers writes the checkpoint, so its config reads back exactly).
Location: ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/models/tiny-qwen3-omni-<key>/, <key> hashing the recipe
and the transformers version; complete when its stamp exists (built in a temporary folder, renamed into
place).

What vLLM-Omni needs beyond transformers' defaults (as for the tiny Qwen2.5-Omni of devsetup.tiny_omni):
a byte-level tokenizer with Qwen's special tokens at their real ids, and the role words at the ids the
config names (the talker reads the role tokens), head_dim 64 (vLLM's CPU attention), interleaved mrope
sections that sum to head_dim/2, 16 code groups (vLLM-Omni's code2wav reads 16 quantizers), the talker's
hidden layer within the thinker's layers. Weights: transformers' initialisers under torch.manual_seed,
the talker's codec head scaled up (so that its codes follow what it is given, the speaker included), stored as
bfloat16 (the engines load them as float32).
"""
from __future__ import annotations

import sys
from pathlib import Path

from omnifleet_runtime.devsetup import tiny_omni

SEED = 20261207
H = 128
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [12, 10, 10], "interleaved": True}
SPECIALS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|audio_pad|>": 151646,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655,
    "<|video_pad|>": 151656, "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<tts_pad>": 151671,
    "<tts_text_bos>": 151672, "<tts_text_eod>": 151673,
}
ROLE_WORDS = {"system": 8948, "user": 872, "assistant": 77091}  # the config's system/user/assistant_token_id
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
RECIPE = {
    "seed": SEED,
    "text": dict(vocab_size=151936, hidden_size=H, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, rope_parameters=ROPE,
                 tie_word_embeddings=False, norm_topk_prob=True, **MOE),
    "audio": dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=256, d_model=128,
                  output_dim=H, downsample_hidden_size=32, n_window=50, n_window_infer=800,
                  max_source_positions=1500),
    "vision": dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=H, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                   deepstack_visual_indexes=[0], image_size=768, apply_vit_abs_pos_embed=True),
    "thinker_ids": dict(audio_start_token_id=151669, audio_end_token_id=151670, vision_start_token_id=151652,
                        vision_end_token_id=151653, user_token_id=872, position_id_per_seconds=25,
                        audio_token_id=151646, image_token_id=151655, video_token_id=151656),
    "talker": dict(
        text_config=dict(vocab_size=3072, hidden_size=H, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                         rope_parameters=ROPE, norm_topk_prob=False, shared_expert_intermediate_size=128, **MOE),
        code_predictor_config=dict(vocab_size=2048, hidden_size=H, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=4096, num_code_groups=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        num_code_groups=16, thinker_hidden_size=H, accept_hidden_layer=1,
        codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        codec_pad_id=2148, codec_bos_id=2149, audio_start_token_id=151669, vision_start_token_id=151652,
        speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, spatial_merge_size=2),
    "code2wav": dict(codebook_size=2048, hidden_size=64, max_position_embeddings=8000, num_attention_heads=2,
                     num_key_value_heads=2, sliding_window=72, intermediate_size=128, num_hidden_layers=1,
                     num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64),
    "specials": SPECIALS,
    "roles": ROLE_WORDS,
    "chat_template": CHAT_TEMPLATE,
    # A random talker's codec logits are nearly flat (initialised weights: a spread of about 0.2), so a seeded
    # draw depends little on what the talker was given; its head scaled up makes its codes follow its input
    # (the speaker included: the voice tests compare audio).
    "talker_head_scale": 50.0,
}


def build(out: Path) -> None:
    import torch
    from transformers import (Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3OmniMoeConfig,
                              Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor, WhisperFeatureExtractor)

    fast = tiny_omni.byte_tokenizer(SPECIALS, CHAT_TEMPLATE, ROLE_WORDS, image_token="<|image_pad|>",
                                    audio_token="<|audio_pad|>", video_token="<|video_pad|>",
                                    vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
                                    audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
    cfg = Qwen3OmniMoeConfig(
        thinker_config=dict(text_config=RECIPE["text"], audio_config=RECIPE["audio"], vision_config=RECIPE["vision"],
                            **RECIPE["thinker_ids"]),
        talker_config=RECIPE["talker"], code2wav_config=RECIPE["code2wav"], enable_audio_output=True)
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(cfg)
    with torch.no_grad():
        model.talker.codec_head.weight.mul_(RECIPE["talker_head_scale"])
    model.to(torch.bfloat16).save_pretrained(out)
    fast.save_pretrained(out)
    # The multimodal processor (vLLM's engine builds its dummy inputs with it); vLLM-Omni's env has torchvision.
    Qwen3OmniMoeProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16),
                          video_processor=Qwen2VLVideoProcessor(patch_size=16),
                          feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=fast,
                          chat_template=CHAT_TEMPLATE).save_pretrained(out)


def ensure() -> Path:
    """The checkpoint's directory, built if missing."""
    return tiny_omni.cached(tiny_omni.model_dir("tiny-qwen3-omni", RECIPE), RECIPE, build)


if __name__ == "__main__":
    sys.exit(tiny_omni.cli(ensure, __doc__))
