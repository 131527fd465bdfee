"""The `diffusion` engine: images from conditioning passed by the upstream stage.

The engine runs a denoising loop (denoiser + scheduler, optional VAE decoder)
whose conditioning comes from upstream, as in an autoregressive -> diffusion
pipeline (the AR stage plans, the diffusion stage paints). Its parts come from:

- **diffusers**, when it is installed and `model` is a diffusers-layout
  directory: the denoiser from `unet/` or `transformer/`, the scheduler from
  `scheduler/`, and, when present, `vae/`, `text_encoder/` (a transformers
  model) and `tokenizer/`; each class is the one its config names
  (`_class_name`, `architectures`), loaded with `from_pretrained`;
- an `entrypoint: module:factory`, when set: `factory(**engineArgs.factory_kwargs)`
  returns the denoiser (`nn.Module`), or a dict with `denoiser` and any of
  `scheduler`, `vae`, `text_encoder`, `tokenizer`. This path needs only
  torch: without diffusers a built-in DDIM scheduler runs the loop.

The denoiser is called as `denoiser(sample, timestep, encoder_hidden_states=cond)`
and returns the noise prediction (a tensor, or an object with `.sample`, as
diffusers models do).

Inputs (one item per request): a dict with the conditioning, one of
`prompt_embeds` (`wire.Array` [seq, dim] or [batch, seq, dim]),
`prompt_token_ids` (needs a text encoder) or `prompt` (needs a tokenizer and
a text encoder), and optionally `sampling_params` overrides; a plain string
is a `prompt`. No conditioning at all generates unconditionally. The same
fields prefixed `negative_` (a CFG companion's output, see companions.py) are
guidance's unconditional branch.

Sampling params (stage defaults, then per request): `height`, `width`,
`num_inference_steps`, `guidance_scale` (> 1: classifier-free guidance against
the negative conditioning, or an all-zero one without it), `seed` (default 0: the same request gives the same
image), `n` (images per request).

engineArgs: `device` (default cuda when available, else cpu), `dtype`
(default float32), `factory_kwargs`, `max_concurrency` (default 1), and
defaults for `height`, `width`, `num_inference_steps`, `guidance_scale`,
`latent_channels` (for a denoiser that does not say). Anything else fails the
stage at start, naming it.

Output: one chunk per request, `{"images": wire.Array uint8 [n, height, width,
channels], "seed": seed}`; the master encodes PNGs.

Control RPCs: `ping`, `stats`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

from ..schema import Stage
from ..wire import Array
from .base import Engine, EngineRequest, EngineStartError, load_callable
from .tensors import array_of, to_tensor
from .vllm import expand_model

log = logging.getLogger("omnifleet.engine.diffusion")

ENGINE_ARGS = {"device", "dtype", "factory_kwargs", "max_concurrency", "height", "width", "num_inference_steps",
               "guidance_scale", "latent_channels"}
SAMPLING = {"height", "width", "num_inference_steps", "guidance_scale", "seed", "n", "num_images_per_prompt"}


class Cancelled(Exception):
    pass


class DDIMScheduler:
    """A deterministic DDIM scheduler (eta 0, scaled-linear betas): the loop's scheduler without diffusers."""

    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012):
        import torch

        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_train_timesteps = num_train_timesteps
        self.init_noise_sigma = 1.0
        self.timesteps: Any = None
        self._step = 1

    def set_timesteps(self, n: int, device: Any = None) -> None:
        import torch

        self._step = max(self.num_train_timesteps // n, 1)
        self.timesteps = (torch.arange(n - 1, -1, -1) * self._step).to(device or "cpu")

    def scale_model_input(self, sample: Any, timestep: Any) -> Any:
        return sample

    def step(self, eps: Any, t: Any, sample: Any) -> Any:
        t = int(t)
        a_t = self.alphas_cumprod[t].to(sample.dtype)
        prev = t - self._step
        a_prev = self.alphas_cumprod[prev].to(sample.dtype) if prev >= 0 else sample.new_tensor(1.0)
        x0 = (sample - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        return SimpleNamespace(prev_sample=a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps)


def diffusers_available() -> bool:
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return False
    return True


class DiffusionEngine(Engine):
    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.args = dict(stage.engine_args)
        self.max_concurrency = self.args.get("max_concurrency", 1)
        self.torch: Any = None
        self.parts: dict[str, Any] = {}
        self.device = "cpu"
        self.dtype: Any = None
        self.source = ""
        self.cancelled: dict[str, threading.Event] = {}
        self.images = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        unknown = sorted(set(self.args) - ENGINE_ARGS)
        if unknown:
            raise EngineStartError(f"stage {self.stage.name!r}: unknown diffusion engine arg(s) "
                                   f"{', '.join(map(repr, unknown))} in engineArgs (known: {', '.join(sorted(ENGINE_ARGS))})")
        import torch

        self.torch = torch
        self.device = self.args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, self.args.get("dtype", "float32"))
        t = time.monotonic()
        try:
            if self.stage.entrypoint:
                parts = await asyncio.to_thread(self._from_factory)
            else:
                parts = await asyncio.to_thread(self._from_diffusers, expand_model(self.stage))
        except EngineStartError:
            raise
        except Exception as e:
            raise EngineStartError(f"stage {self.stage.name!r}: the diffusion model could not load: "
                                   f"{type(e).__name__}: {e}") from e
        for name, part in parts.items():
            if isinstance(part, torch.nn.Module):
                parts[name] = part.to(self.device, self.dtype).eval()
        self.parts = parts
        log.info("stage %s: diffusion engine (%s; denoiser %s, scheduler %s%s) ready in %.1fs", self.stage.name,
                 self.source, type(parts["denoiser"]).__name__, type(parts["scheduler"]).__name__,
                 "".join(f", {k} {type(parts[k]).__name__}" for k in ("vae", "text_encoder") if k in parts),
                 time.monotonic() - t)

    def _from_factory(self) -> dict[str, Any]:
        made = load_callable(self.stage.entrypoint)(**self.args.get("factory_kwargs", {}))
        parts = dict(made) if isinstance(made, dict) else {"denoiser": made}
        if not isinstance(parts.get("denoiser"), self.torch.nn.Module):
            raise TypeError(f"{self.stage.entrypoint} returned no nn.Module denoiser")
        if "scheduler" not in parts:
            parts["scheduler"] = _default_scheduler()
        self.source = f"factory {self.stage.entrypoint}"
        return parts

    def _from_diffusers(self, model: str) -> dict[str, Any]:
        if not diffusers_available():
            raise EngineStartError(f"stage {self.stage.name!r}: loading {model} needs diffusers, which is not "
                                   "installed; install it, or set an entrypoint (module:factory returning a "
                                   "torch denoiser)")
        import diffusers

        root = Path(model)
        sub = next((s for s in ("unet", "transformer") if (root / s / "config.json").exists()), None)
        if sub is None:
            raise EngineStartError(f"stage {self.stage.name!r}: {model} has no unet/ or transformer/ "
                                   "(a diffusers-layout model directory is expected)")

        def load(subfolder: str, config: str) -> Any:
            name = json.loads((root / subfolder / config).read_text())["_class_name"]
            kwargs = {} if subfolder == "scheduler" else {"torch_dtype": self.dtype}
            return getattr(diffusers, name).from_pretrained(model, subfolder=subfolder, **kwargs)

        parts = {"denoiser": load(sub, "config.json"), "scheduler": load("scheduler", "scheduler_config.json")}
        if (root / "vae" / "config.json").exists():
            parts["vae"] = load("vae", "config.json")
        if (root / "text_encoder" / "config.json").exists():
            import transformers

            arch = json.loads((root / "text_encoder" / "config.json").read_text())["architectures"][0]
            parts["text_encoder"] = getattr(transformers, arch).from_pretrained(root / "text_encoder")
        if (root / "tokenizer").is_dir():
            from transformers import AutoTokenizer

            parts["tokenizer"] = AutoTokenizer.from_pretrained(root / "tokenizer")
        self.source = f"diffusers {diffusers.__version__}, {model}"
        return parts

    # ------------------------------------------------------------ requests

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        async for item in request.inputs:
            flag = self.cancelled.setdefault(request.request_id, threading.Event())
            try:
                out = await asyncio.to_thread(self.run, item, request.sampling_params, flag)
            except asyncio.CancelledError:
                flag.set()  # the loop stops at its next step
                raise
            finally:
                self.cancelled.pop(request.request_id, None)
            request.last = request.inputs_ended()  # one output per input
            yield out

    async def abort(self, request_id: str) -> None:
        if flag := self.cancelled.get(request_id):
            flag.set()

    def settings(self, params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        p = {k: self.args[k] for k in ("height", "width", "num_inference_steps", "guidance_scale") if k in self.args}
        p.update(params)
        p.update(overrides)
        unknown = sorted(set(p) - SAMPLING)
        if unknown:
            raise ValueError(f"stage {self.stage.name!r}: unknown sampling parameter(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(SAMPLING))})")
        den = self.parts["denoiser"]
        size = getattr(getattr(den, "config", None), "sample_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        default = (size or 32) * self._vae_scale()
        out = {"height": int(p.get("height") or default), "width": int(p.get("width") or default),
               "steps": int(p.get("num_inference_steps") or 20), "guidance": float(p.get("guidance_scale") or 1.0),
               "seed": int(p["seed"]) if p.get("seed") is not None else 0,
               "n": int(p.get("n") or p.get("num_images_per_prompt") or 1)}
        scale = self._vae_scale()
        for k in ("height", "width"):
            if out[k] <= 0 or out[k] % scale or out[k] > 4096:
                raise ValueError(f"stage {self.stage.name!r}: {k} {out[k]} must be a positive multiple of {scale}, "
                                 "at most 4096")
        if not 1 <= out["steps"] <= 1000 or not 1 <= out["n"] <= 16:
            raise ValueError(f"stage {self.stage.name!r}: num_inference_steps must be in 1..1000 and n in 1..16")
        return out

    def _vae_scale(self) -> int:
        vae = self.parts.get("vae")
        blocks = getattr(getattr(vae, "config", None), "block_out_channels", None)
        return 2 ** (len(blocks) - 1) if blocks else 1

    def conditioning(self, item: Any, prefix: str = "") -> Any:
        """The encoder states of the item's `prompt_embeds`, `prompt_token_ids` or `prompt` (those of
        `negative_prompt_embeds`, ... with prefix "negative_"); None when it has none."""
        torch = self.torch
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict):
            raise ValueError(f"stage {self.stage.name!r}: expected a dict with prompt_embeds, prompt_token_ids or "
                             f"prompt, got {type(item).__name__}")
        if isinstance(item.get(f"{prefix}prompt_embeds"), Array):
            emb = to_tensor(item[f"{prefix}prompt_embeds"], self.device).to(self.dtype)
            return emb if emb.dim() == 3 else emb.unsqueeze(0)
        ids = item.get(f"{prefix}prompt_token_ids")
        if ids is None and item.get(f"{prefix}prompt") is not None:
            tok = self.parts.get("tokenizer")
            if tok is None:
                raise ValueError(f"stage {self.stage.name!r}: a text prompt needs a tokenizer (tokenizer/ in the "
                                 "model); pass prompt_embeds or prompt_token_ids instead")
            ids = tok(item[f"{prefix}prompt"])["input_ids"]
        if ids is None:
            return None
        enc = self.parts.get("text_encoder")
        if enc is None:
            raise ValueError(f"stage {self.stage.name!r}: token ids need a text encoder (text_encoder/ in the model)")
        limit = getattr(getattr(enc, "config", None), "max_position_embeddings", None) or len(ids)
        ids = list(ids)[:limit] or [0]
        out = enc(torch.tensor([ids], device=self.device))
        if not torch.is_tensor(out):  # a transformers output
            out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return out.to(self.dtype)

    def run(self, item: Any, params: dict[str, Any], cancelled: threading.Event) -> dict[str, Any]:
        torch = self.torch
        overrides = dict(item.get("sampling_params") or {}) if isinstance(item, dict) else {}
        s = self.settings(params, overrides)
        den, sched, vae = self.parts["denoiser"], self.parts["scheduler"], self.parts.get("vae")
        with torch.inference_mode():
            cond = self.conditioning(item)
            n = s["n"]
            if cond is not None:
                cond = cond.expand(n, -1, -1) if cond.shape[0] == 1 else cond
            channels = (getattr(getattr(den, "config", None), "in_channels", None) or getattr(den, "in_channels", None)
                        or self.args.get("latent_channels") or 3)
            scale = self._vae_scale()
            gen = torch.Generator("cpu").manual_seed(s["seed"])
            shape = (n, channels, s["height"] // scale, s["width"] // scale)
            latents = torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device, self.dtype)
            sched.set_timesteps(s["steps"], device=self.device)
            latents = latents * sched.init_noise_sigma
            cfg = s["guidance"] > 1.0 and cond is not None
            # The unconditional branch: a negative prompt's states (a CFG companion's output), else zeros.
            neg = self.conditioning(item, "negative_") if cfg else None
            if cfg:
                neg = torch.zeros_like(cond) if neg is None else neg.expand(n, -1, -1) if neg.shape[0] == 1 else neg
            together = cfg and neg.shape == cond.shape  # one batched call; else one call per branch
            context = torch.cat([neg, cond]) if together else cond
            m, stage = self.metrics, self.stage.name
            for t in sched.timesteps:
                if cancelled.is_set():
                    raise Cancelled("aborted")
                step_t0 = time.perf_counter()
                x = torch.cat([latents, latents]) if together else latents
                x = sched.scale_model_input(x, t)
                eps = self._denoise(den, x, t, context)
                if together:
                    uncond, conditioned = eps.chunk(2)
                elif cfg:
                    uncond, conditioned = self._denoise(den, x, t, neg), eps  # x: these latents, scaled
                if cfg:
                    eps = uncond + s["guidance"] * (conditioned - uncond)
                latents = sched.step(eps, t, latents).prev_sample
                if m is not None:
                    m.diffusion_step.observe(time.perf_counter() - step_t0, stage=stage)
            image = latents
            if vae is not None:
                factor = getattr(vae.config, "scaling_factor", 1.0)
                image = vae.decode(latents / factor).sample
            if image.shape[1] not in (1, 3, 4):
                raise ValueError(f"stage {self.stage.name!r}: the model makes {image.shape[1]} channels, not an "
                                 "image (1, 3 or 4)")
            pixels = ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
        self.images += n
        if self.metrics is not None:
            self.metrics.images.inc(n, stage=self.stage.name)
        return {"images": array_of(pixels.contiguous()), "seed": s["seed"]}

    def _denoise(self, den: Any, x: Any, t: Any, context: Any) -> Any:
        torch = self.torch
        tt = t.expand(x.shape[0]).to(self.device) if torch.is_tensor(t) else torch.full((x.shape[0],), t)
        eps = den(x, tt, encoder_hidden_states=context)
        return eps.sample if hasattr(eps, "sample") else eps[0] if isinstance(eps, tuple) else eps

    # ------------------------------------------------------------ control

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        if method == "ping":
            return {"pong": True, "stage": self.stage.name, "replica": self.replica, "pid": os.getpid(),
                    "engine": "diffusion", "source": self.source, "device": self.device}
        if method == "stats":
            return {"images": self.images, "active": len(self.cancelled)}
        raise ValueError(f"unsupported control method {method!r} for a diffusion stage (ping, stats)")


def _default_scheduler() -> Any:
    if diffusers_available():
        from diffusers import DDIMScheduler as Diffusers

        return Diffusers(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                         set_alpha_to_one=True)
    return DDIMScheduler()
