"""Time to first audio of a streaming speech pipeline vs the upstream stage's own time to first token + one hop.

    .venv/bin/python -m bench.speech_ttfa [--rounds 7] [--requests 10]

A master and two stage pods (real processes on loopback, as `omnifleet master|stage` run them,
through bench.wrapper): thinker (vLLM on the tiny Qwen2 model the tests generate, greedy,
`ignore_eos`) streams its tokens into vocoder (a python stage in `stream` input mode,
`bench.fns:vocode`: 10 ms of 24 kHz audio per token delta, at once, so that the figure is the
pipeline's and not a vocoder's). The processes share the benchmark's session, so the kernel schedules
them as one group (a session each had a pod that woke for a chunk wait 40-60 ms behind the thinker's
busy engine processes: bench.common.Proc).

Each round, in alternating order (odd rounds pipeline first), `--requests` requests one after
another per side:

- pipeline: `/v1/audio/speech` with `response_format: pcm` (streamed as the vocoder makes it);
  time to first audio is the client's time from sending the request to its first PCM bytes;
- upstream: the thinker stage's own engine on the same prompt and sampling parameters (the stage's
  `generate` control method: vLLM's `AsyncLLM.generate` in the stage process, nothing of the
  pipeline in between); time to first token is that call's time to its first output with a token,
  measured inside the stage process;
- hop: raw ZMQ round trips of 64 bytes (DEALER -> ROUTER echo, `bench.raw`), as many.

Ratio per round = median time to first audio / (median time to first token + median raw round
trip). The same again with one thinker token per request (the engine idle once it has made it):
what the pipeline's path costs without the engine decoding the rest on the same cores. Each side records the cores the rest of the machine took meanwhile ("outside load");
headline: the median over the rounds in which neither side saw more than OUTSIDE_LOAD_MAX
cores (all rounds when none is clean, and the report says so); every round is kept. Results:
bench/results/<date>-speech-ttfa.{md,json} and latest.json["speech_ttfa"].
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import time
from pathlib import Path
from typing import Any

from . import common as C
from . import goals
from .raw import Server, zmq_rtt
from .vllm_pipeline import ENGINE, OUTSIDE_LOAD_MAX, OutsideLoad, control, tree

PROMPT = "Say something: one, two, three"


def stages(model: str) -> list[dict[str, Any]]:
    return [
        {"name": "thinker", "type": "llm", "gpus": 0, "model": model, "engineArgs": ENGINE},
        {"name": "vocoder", "type": "python", "entrypoint": "bench.fns:vocode", "inputs": ["thinker"],
         "inputMode": "stream", "finalOutput": "audio"},
    ]


def speech(fleet: C.Fleet, params: dict[str, Any]) -> tuple[float, int]:
    """(seconds to the first PCM bytes, all PCM bytes) of one streamed speech request."""
    body = json.dumps({"model": "bench", "input": PROMPT, "response_format": "pcm",
                       "stage_sampling_params": {"thinker": params}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", fleet.api_port, timeout=120)
    try:
        t = time.perf_counter()
        conn.request("POST", "/v1/audio/speech", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"speech request failed: HTTP {resp.status}: {resp.read()[:500]!r}")
        first = resp.read1(65536)
        ttfa = time.perf_counter() - t
        if not first:
            raise RuntimeError("the speech stream ended without audio")
        return ttfa, len(first) + len(resp.read())
    finally:
        conn.close()


def upstream(fleet: C.Fleet, params: dict[str, Any]) -> tuple[float, list[int]]:
    """(the thinker engine's own time to first token, its token ids) for the same prompt."""
    out = control(fleet, "thinker", "generate", {"prompts": [PROMPT], "sampling_params": params})["outputs"][0]
    if out.get("first_token_s") is None:
        raise RuntimeError(f"the thinker's engine produced no token: {out}")
    return out["first_token_s"], out["token_ids"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    params = {"temperature": 0.0, "max_tokens": args.tokens, "ignore_eos": True}
    one = {**params, "max_tokens": 1}
    rounds: list[dict[str, Any]] = []
    port = C.free_port()
    with C.Fleet("ttfa", stages(model), env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as fleet, \
            Server("zmq-echo", str(port), "sync") as echo:
        t = time.perf_counter()
        fleet.start_master()
        fleet.start_pod("thinker-0", "thinker")
        fleet.start_pod("vocoder-0", "vocoder")
        fleet.wait_ready(timeout=args.start_timeout)
        start_s = time.perf_counter() - t
        C.log(f"fleet ready in {start_s:.0f} s")
        for _ in range(3):  # warm both paths (first-request compilation, caches, connections)
            speech(fleet, params)
            upstream(fleet, params)
        ours = tree([os.getpid(), echo.pid, *(p.pid for p in fleet.procs.values())])
        deadline = time.monotonic() + args.time_limit
        for rnd in range(1, args.rounds + 1):
            if time.monotonic() > deadline:
                C.log(f"time limit reached after {rnd - 1} rounds")
                break
            pipeline_first = rnd % 2 == 1
            r: dict[str, Any] = {"round": rnd, "order": "pipeline first" if pipeline_first else "upstream first"}
            for side in (("pipeline", "upstream") if pipeline_first else ("upstream", "pipeline")):
                with OutsideLoad(ours) as load:
                    if side == "pipeline":
                        got = [speech(fleet, params) for _ in range(args.requests)]
                        r["ttfa_s"] = [round(x, 5) for x, _ in got]
                        r["pcm_bytes"] = sorted({n for _, n in got})
                    else:
                        got = [upstream(fleet, params) for _ in range(args.requests)]
                        r["ttft_s"] = [round(x, 5) for x, _ in got]
                        if any(ids != got[0][1] for _, ids in got) or len(got[0][1]) != args.tokens:
                            raise RuntimeError(f"round {rnd}: the thinker's tokens vary or fall short: {got}")
                r[f"outside_load_cores_{side}"] = load.cores
            # One token: the same path with the engine idle after its first token.
            r["ttfa_1_token_s"] = [round(speech(fleet, one)[0], 5) for _ in range(args.requests)]
            r["ttft_1_token_s"] = [round(upstream(fleet, one)[0], 5) for _ in range(args.requests)]
            r["raw_rtt_s"] = [round(x, 6) for x in zmq_rtt(port, 64, args.requests, 5, 30.0)]
            r["ttfa_p50_ms"] = round(C.pct(r["ttfa_s"], 50) * 1e3, 2)
            r["ttft_p50_ms"] = round(C.pct(r["ttft_s"], 50) * 1e3, 2)
            r["raw_rtt_p50_ms"] = round(C.pct(r["raw_rtt_s"], 50) * 1e3, 3)
            r["ratio"] = round(r["ttfa_p50_ms"] / (r["ttft_p50_ms"] + r["raw_rtt_p50_ms"]), 3)
            r["ratio_1_token"] = round(C.pct(r["ttfa_1_token_s"], 50) * 1e3 / (C.pct(r["ttft_1_token_s"], 50) * 1e3
                                                                               + r["raw_rtt_p50_ms"]), 3)
            r["clean"] = max(r["outside_load_cores_pipeline"], r["outside_load_cores_upstream"]) <= OUTSIDE_LOAD_MAX
            C.log(f"round {rnd}: time to first audio {r['ttfa_p50_ms']} ms, upstream time to first token "
                  f"{r['ttft_p50_ms']} ms + hop {r['raw_rtt_p50_ms']} ms: {r['ratio']}x; one token: "
                  f"{r['ratio_1_token']}x ({r['order']}; outside "
                  f"load {r['outside_load_cores_pipeline']}/{r['outside_load_cores_upstream']} cores)")
            rounds.append(r)
    return {"model": model, "engine_args": ENGINE, "prompt": PROMPT, "tokens": args.tokens,
            "requests_per_side": args.requests, "fleet_start_s": round(start_s, 1), "rounds": rounds}


def headline(res: dict[str, Any]) -> dict[str, Any]:
    everyone = res["rounds"]
    rs = [r for r in everyone if r["clean"]] or everyone
    return {
        "headline_rounds": (f"{len(rs)} of {len(everyone)} rounds clean (outside load <= {OUTSIDE_LOAD_MAX} "
                            "cores on both sides)" if rs is not everyone else
                            f"no clean round of {len(everyone)}: median of all"),
        "ttfa_over_upstream_ttft_plus_hop": round(C.pct([r["ratio"] for r in rs], 50), 3),
        "ttfa_over_upstream_ttft_plus_hop_rounds": [r["ratio"] for r in everyone],
        "ttfa_over_upstream_ttft_plus_hop_all_rounds_median": round(C.pct([r["ratio"] for r in everyone], 50), 3),
        "ttfa_over_upstream_ttft_plus_hop_1_token": round(C.pct([r["ratio_1_token"] for r in rs], 50), 3),
        "ttfa_over_upstream_ttft_plus_hop_1_token_rounds": [r["ratio_1_token"] for r in everyone],
        "ttfa_p50_ms": round(C.pct([r["ttfa_p50_ms"] for r in rs], 50), 2),
        "upstream_ttft_p50_ms": round(C.pct([r["ttft_p50_ms"] for r in rs], 50), 2),
        "raw_rtt_p50_ms": round(C.pct([r["raw_rtt_p50_ms"] for r in rs], 50), 3),
        "rounds": len(everyone),
    }


def report(res: dict[str, Any], h: dict[str, Any], facts: dict[str, Any]) -> str:
    goal = goals.by_key("speech_ttfa", "ttfa_over_upstream_ttft_plus_hop")
    rows = [[r["round"], r["order"], r["ttfa_p50_ms"], r["ttft_p50_ms"], r["raw_rtt_p50_ms"], f"{r['ratio']:.3f}",
             f"{r['ratio_1_token']:.3f}", f"{r['outside_load_cores_pipeline']} / {r['outside_load_cores_upstream']}",
             "yes" if r["clean"] else "no"] for r in res["rounds"]]
    return "\n".join([
        "# Time to first audio of a streaming speech pipeline", "",
        __doc__.split("\n\n", 2)[2].strip(), "",
        f"{res['requests_per_side']} requests per side per round, {res['tokens']} thinker tokens each; fleet start "
        f"{res['fleet_start_s']} s.", "",
        f"**Headline: {h['ttfa_over_upstream_ttft_plus_hop']:.3f}x** ({h['headline_rounds']}; median of all "
        f"{h['rounds']} rounds {h['ttfa_over_upstream_ttft_plus_hop_all_rounds_median']:.3f}x; goal {goal.text()}: "
        f"{goal.verdict(h['ttfa_over_upstream_ttft_plus_hop'])}): time to first audio {h['ttfa_p50_ms']} ms, the "
        f"thinker engine's own time to first token {h['upstream_ttft_p50_ms']} ms, a raw ZMQ round trip "
        f"{h['raw_rtt_p50_ms']} ms. With one thinker token per request (the engine idle after it): "
        f"{h['ttfa_over_upstream_ttft_plus_hop_1_token']:.3f}x.", "",
        C.md_table(["round", "order", "time to first audio p50, ms", "upstream time to first token p50, ms",
                    "raw ZMQ round trip p50, ms", "ratio", "ratio, one token", "outside load, cores (pipeline / upstream)",
                    "clean"],
                   rows), "",
        C.facts_table(facts), "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speech_ttfa", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--requests", type=int, default=10, help="requests per side per round")
    p.add_argument("--tokens", type=int, default=16, help="thinker tokens per request")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--time-limit", type=float, default=900.0, help="no round starts after this many seconds")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    args = p.parse_args(argv)
    facts = C.machine_facts()
    facts["command"] = " ".join([".venv/bin/python -m bench.speech_ttfa", *(argv or [])])
    prov = C.provenance("speech_ttfa")
    t0 = time.monotonic()
    res = run(args)
    if not res["rounds"]:
        C.log("no round completed")
        return 1
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    h = headline(res)
    stem = f"{C.today()}-speech-ttfa"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(report(res, h, facts))
    (args.out / f"{stem}.json").write_text(json.dumps({"facts": facts, "provenance": prov, **res, "headline": h},
                                                      indent=1) + "\n")
    C.merge_latest(args.out, "speech_ttfa", {**h, "report": f"{stem}.md", "machine": C.machine_line(facts)}, prov)
    print(json.dumps(h, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raise SystemExit(main())
