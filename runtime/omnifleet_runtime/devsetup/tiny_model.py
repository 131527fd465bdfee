"""Deterministic tiny models for tests (no weights can be downloaded here).

    python -m omnifleet_runtime.devsetup.tiny_model [--out DIR] [--name tiny-qwen2|tiny-diffusion] [--print-path]

tiny-qwen2: a 2-layer Qwen2 causal LM with a trained byte-level BPE tokenizer (vLLM runs it).
tiny-diffusion (needs diffusers): a diffusers-layout directory the diffusion engine
loads: unet/ (UNet2DConditionModel, cross-attention dim 32), scheduler/ (DDIM),
vae/ (AutoencoderKL, 4 latent channels, 2x), text_encoder/ (CLIPTextModel over
tiny-qwen2's 512-token vocabulary, so an LLM stage's token ids condition it) and
tokenizer/ (tiny-qwen2's).

Default location: ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/models/<name>-<key>/, where
<key> hashes the recipe below, so changing the recipe makes a new directory.
A model is complete when its stamp file exists (written last into the build
directory, which is then renamed into place); otherwise it is built.

Weights come from numpy's legacy RandomState (its stream is frozen by NEP 19 and
has no CPU-specific SIMD path), not from torch's initialisers, so the same bytes
come out on any machine and any torch version; CHECKSUMS pins them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

STAMP = ".omnifleet-complete"
SEED = 20261130

QWEN2 = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1,  # head_dim 64: CPU attention rejects 16
    tie_word_embeddings=True, max_position_embeddings=8192,  # long enough to abort mid-generation
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A pipeline has stages: a thinker, a talker and a vocoder that turns codes into audio.",
    "The master routes each request through the stages and streams the output back.",
    "Every stage replica registers with the master and sends heartbeats both ways.",
    "Kubernetes runs pods; a Deployment keeps the replicas alive; a Service names the ports.",
    "Hello world! How are you today? I am fine, thank you. What time is it?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 2026",
    "Images are made by a diffusion model from the tokens of an autoregressive model.",
    "Speech is streamed in chunks so that the first audio does not wait for the whole text.",
    "The user asked a question and the assistant gave a short, helpful answer.",
    "Tests must be deterministic: the same seed gives the same weights and the same tokens.",
    "Rain in the morning, sun in the afternoon, and a cold wind in the evening.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
] * 4
# sha256 of the model content (tensors by name + vocabulary); a mismatch means the
# recipe stopped being deterministic somewhere.
CHECKSUMS = {"tiny-qwen2": "a2e190eb91745775105b23d870ca74132573f0292b508e2ffdb2ecec93fc27b2",
             "tiny-diffusion": "2eb9d7674149b531f0f16f6d67b9d3bf7cc504ae905f41a692aa18f3ddb0d790"}
DIFFUSION = {
    "unet": dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=[32, 64],
                 down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=32, attention_head_dim=8,
                 norm_num_groups=8),
    "vae": dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], block_out_channels=[8, 16],
                latent_channels=4, norm_num_groups=8, layers_per_block=1, sample_size=32),
    "scheduler": dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                      set_alpha_to_one=True, num_train_timesteps=1000),
    "text_encoder": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=256, projection_dim=32,
                         bos_token_id=0, eos_token_id=2, pad_token_id=0),
}
RECIPES = {"tiny-qwen2": (QWEN2, SPECIALS, CHAT_TEMPLATE, CORPUS, SEED, "v1"),
           "tiny-diffusion": (DIFFUSION, SEED, "v1")}

_t0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[tiny_model {time.monotonic() - _t0:5.1f}s] {msg}", flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")


def model_dir(name: str) -> Path:
    key = hashlib.sha256(json.dumps(RECIPES[name], sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{key}"


def content_checksum(out: Path) -> str:
    """Hash of what the model *is* (tensor bytes, vocabulary), not of file layout."""
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        h.update(_safetensors_raw(f))
    for f in sorted(out.glob("*/*.safetensors")):  # diffusers layout: one folder per component
        h.update(f.parent.name.encode() + _safetensors_raw(f))
    tok = out / "tokenizer.json" if (out / "tokenizer.json").exists() else out / "tokenizer" / "tokenizer.json"
    vocab = json.loads(tok.read_text())["model"]["vocab"]
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    return h.hexdigest()


def _safetensors_raw(f: Path) -> bytes:
    """Tensor names, dtypes, shapes and bytes in name order, ignoring header formatting
    (read raw: numpy cannot hold bfloat16)."""
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    out = bytearray()
    for name in sorted(header):
        t = header[name]
        a, b = t["data_offsets"]
        out += f"{name}|{t['dtype']}|{t['shape']}|".encode() + data[8 + n + a:8 + n + b]
    return bytes(out)


def build_tiny_qwen2(out: Path) -> None:
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    log("training byte-level BPE tokenizer (vocab 512)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=QWEN2["vocab_size"], special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == QWEN2["vocab_size"], tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)

    log("building Qwen2ForCausalLM with seeded weights")
    config = Qwen2Config(**QWEN2, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"),
                         pad_token_id=tok.token_to_id("<|endoftext|>"), dtype="bfloat16")
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    rng = np.random.RandomState(SEED)
    state = {}
    for name, p in sorted(model.state_dict().items()):
        if "norm" in name:
            value = np.ones(p.shape)
        elif name.endswith(".bias"):
            value = np.zeros(p.shape)
        else:
            # Wide embeddings give clear greedy margins, so argmax is robust to
            # float noise between batch shapes; 0.02 elsewhere as in Qwen2's init.
            std = 0.5 if "embed_tokens" in name else 0.02
            value = rng.standard_normal(p.shape) * std
        state[name] = torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.to(torch.bfloat16).save_pretrained(out)


def _seeded(module, rng) -> None:
    """Fill a module's parameters from numpy's frozen RandomState stream (same bytes everywhere):
    norms 1, biases 0, embeddings N(0, 1), other weights N(0, 1/fan_in)."""
    import numpy as np
    import torch

    state = {}
    for name, p in sorted(module.state_dict().items()):
        if not p.is_floating_point():  # buffers such as position ids stay as built
            state[name] = p
            continue
        if "norm" in name and name.endswith(".weight"):
            value = np.ones(p.shape)
        elif name.endswith(".bias") or p.dim() == 0:
            value = np.zeros(p.shape)
        elif "embedding" in name or p.dim() == 1:
            value = rng.standard_normal(p.shape)
        else:
            value = rng.standard_normal(p.shape) / np.sqrt(max(int(np.prod(p.shape[1:])), 1))
        state[name] = torch.from_numpy(value.astype(np.float32)).to(p.dtype)
    module.load_state_dict(state, strict=True)


def build_tiny_diffusion(out: Path) -> None:
    import numpy as np
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    rng = np.random.RandomState(SEED)
    log("building UNet2DConditionModel, AutoencoderKL and CLIPTextModel with seeded weights")
    for sub, model in (("unet", UNet2DConditionModel(**DIFFUSION["unet"])),
                       ("vae", AutoencoderKL(**DIFFUSION["vae"])),
                       ("text_encoder", CLIPTextModel(CLIPTextConfig(**DIFFUSION["text_encoder"])))):
        _seeded(model, rng)
        model.save_pretrained(out / sub)
    DDIMScheduler(**DIFFUSION["scheduler"]).save_pretrained(out / "scheduler")
    shutil.copytree(ensure_tiny_model("tiny-qwen2"), out / "tokenizer",
                    ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json", ".*",
                                                  "checksum.sha256"))


BUILDERS = {"tiny-qwen2": build_tiny_qwen2, "tiny-diffusion": build_tiny_diffusion}


def readable_by_all(root: Path) -> None:
    """Pods read the model as a non-root user (a hostPath volume keeps the files' modes):
    some writers (safetensors) create files 0600."""
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        want = mode | (0o555 if p.is_dir() else 0o444)
        if want != mode:
            p.chmod(want)


def ensure_tiny_model(name: str = "tiny-qwen2", out: Path | str | None = None) -> Path:
    """Return the directory of the named tiny model, building it once.

    The model is built in a temporary sibling directory, stamped last, then renamed
    into place, so a directory at the final path is always complete, even with
    several processes racing to build it.
    """
    final = Path(out) if out else model_dir(name)
    if (final / STAMP).exists():
        readable_by_all(final)
        return final
    if final.exists() and any(final.iterdir()):
        raise FileExistsError(f"{final} exists but is not a complete {name} (no {STAMP}); remove it")
    log(f"building {name} into {final}")
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        BUILDERS[name](tmp)
        digest = content_checksum(tmp)
        expected = CHECKSUMS.get(name)
        if expected and digest != expected:
            raise RuntimeError(f"{name}: content checksum {digest} != expected {expected}: "
                               "the recipe is no longer deterministic (library change?)")
        (tmp / "checksum.sha256").write_text(digest + "\n")
        readable_by_all(tmp)
        (tmp / STAMP).write_text(digest + "\n")
        if final.exists() and not (final / STAMP).exists():
            final.rmdir()  # empty (checked above)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / STAMP).exists():
                raise
            log("another process built it first")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done: {final} (sha256 {digest[:16]})")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="tiny-qwen2", choices=sorted(BUILDERS))
    ap.add_argument("--out", help="target directory (default: the cache)")
    ap.add_argument("--print-path", action="store_true", help="print only the model's directory (build it first)")
    args = ap.parse_args(argv)
    if args.print_path:
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):
            path = ensure_tiny_model(args.name, args.out)
        print(path)
        return 0
    path = ensure_tiny_model(args.name, args.out)
    log(f"{args.name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
