"""Hidden states out of stock vLLM: a worker extension that records the decoder's last hidden states.

Stock vLLM has no output of hidden states (a downstream talker is made of the
thinker's). Named as vLLM's `worker_extension_cls` in an `llm` stage's
`engineArgs` (`omnifleet_runtime.engines.hidden.HiddenStatesTap`), it is mixed
into vLLM's worker (vLLM's documented extension point); the stage then calls it
through `collective_rpc`:

- `omnifleet_hidden_install()`, once the engine is up: a forward hook on the
  decoder's final norm (the model's language model: `get_language_model().model`
  for a multimodal model, `.model` otherwise) records each step's rows, split
  by request in the batch's order, at each request's token positions (a
  recomputed request overwrites its rows instead of adding to them);
- `omnifleet_hidden_take(request_id)`: that request's rows, float32
  `[forwarded tokens, hidden]` (its prompt and every generated token but the last,
  which is never forwarded), forgotten once taken; as `[shape, float32 bytes]`;
- `omnifleet_hidden_drop(request_id)`: forget them (an aborted request).

Hooks on submodules fire only when the model runs eagerly (`enforce_eager`):
vLLM's compiled forward bypasses them. A cached prompt prefix is never
forwarded, so prefix caching must be off. The stage checks both at start.
"""

from __future__ import annotations

from typing import Any

TAP = "omnifleet_runtime.engines.hidden.HiddenStatesTap"
MAX_KEPT = 4096  # requests with rows not yet taken (a stage takes or drops each; this bounds any leak)


class HiddenStatesTap:
    """Mixed into vLLM's worker class; every name starts with `omnifleet_` (vLLM refuses clashes)."""

    def omnifleet_hidden_install(self) -> str:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        lm = model.get_language_model() if hasattr(model, "get_language_model") else model
        decoder = getattr(lm, "model", lm)
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise RuntimeError(f"{type(model).__name__}: no final norm found on its decoder "
                               f"({type(decoder).__name__}) to take hidden states from")
        self.omnifleet_rows: dict[str, list[tuple[int, Any]]] = {}
        self.omnifleet_step: dict[str, int] | None = None
        run = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self.omnifleet_step = scheduler_output.num_scheduled_tokens  # the rows of this step, per request
            try:
                return run(scheduler_output, *args, **kwargs)
            finally:
                self.omnifleet_step = None

        runner.execute_model = execute_model
        norm.register_forward_hook(self.omnifleet_record)
        return type(norm).__name__

    def omnifleet_record(self, module: Any, args: Any, out: Any) -> None:
        step = self.omnifleet_step
        if step is None:  # a warm-up or profiling run, not a scheduled step
            return
        hidden = out[0] if isinstance(out, tuple) else out
        batch = self.model_runner.input_batch  # type: ignore[attr-defined]
        at = 0
        for i, req_id in enumerate(batch.req_ids):
            n = step.get(req_id, 0)
            if n:
                start = int(batch.num_computed_tokens_cpu[i])  # this step's first token position
                kept = self.omnifleet_rows.setdefault(req_id, [])
                kept.append((start, hidden[at:at + n].detach().float().cpu().clone()))
            at += n
        while len(self.omnifleet_rows) > MAX_KEPT:
            self.omnifleet_rows.pop(next(iter(self.omnifleet_rows)))

    def _omnifleet_pop(self, request_id: str) -> list[tuple[int, Any]]:
        # vLLM adds a suffix to the id a request was given ("<id>-<8 hex>")
        keys = [k for k in self.omnifleet_rows if k == request_id or k.startswith(request_id + "-")]
        return [p for k in keys for p in self.omnifleet_rows.pop(k)]

    def omnifleet_hidden_take(self, request_id: str) -> list | None:
        import torch

        pieces = self._omnifleet_pop(request_id)
        if not pieces:
            return None
        rows = max(start + t.shape[0] for start, t in pieces)
        out = torch.empty(rows, pieces[0][1].shape[-1], dtype=torch.float32)
        filled = torch.zeros(rows, dtype=torch.bool)
        for start, t in pieces:  # in order: a recomputation overwrites what it recomputed
            out[start:start + t.shape[0]] = t
            filled[start:start + t.shape[0]] = True
        if not bool(filled.all()):
            raise RuntimeError(f"request {request_id}: hidden states of {int((~filled).sum())} of {rows} "
                               "positions were never computed (a cached prompt prefix? prefix caching must be off)")
        # vLLM's RPC result encoding takes plain values: the raw float32 bytes and their shape
        return [list(out.shape), out.numpy().tobytes()]

    def omnifleet_hidden_drop(self, request_id: str) -> None:
        self._omnifleet_pop(request_id)
