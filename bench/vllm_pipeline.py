"""Two-stage vLLM pipeline through the runtime vs the same engines called through vLLM's API directly.

    .venv/bin/python -m bench.vllm_pipeline [--rounds 5] [--quick]

A master and two stage pods (real processes on loopback, as `omnifleet master|stage` run them,
through bench.wrapper): thinker (vLLM) -> talker (vLLM, `processors:llm_text`), both on the
tiny Qwen2 model the tests generate (`devsetup.tiny_model`), greedy, `ignore_eos`.

Each round, in alternating order (odd rounds pipeline first):

- pipeline: `--concurrency` chat requests at once through the master's HTTP API, each
  generating `--tokens` thinker tokens then `--tokens` talker tokens; the time is the client's
  wall clock from the first request sent to the last answer;
- direct: the stage's `generate` control method runs the *same engine instance* (vLLM's
  `AsyncLLM.generate`, one call per prompt, concurrently) with the same prompts, then the talker
  on the thinker's texts, no pipeline in between; the time is what the engines' own calls took
  (measured inside the stage processes; the control round trips are reported beside it).

Ratio = pipeline tokens/s over direct tokens/s for the same tokens (the talker's token ids
must be equal on both sides, or the round is an error, not a figure). The machine may be
shared: each side also records the cores the rest of the machine (not the fleet, not this
process) took meanwhile ("outside load"). Headline: the median over the rounds in which neither
side saw more than OUTSIDE_LOAD_MAX cores of outside load (the same filter for both sides; all
rounds when none is clean, and the report says which); every round is kept. Results: bench/results/<date>-vllm-pipeline.{md,json}
and latest.json["vllm_pipeline"] (quick runs: "-quick" files and "vllm_pipeline_quick").
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from . import common as C
from . import goals

OUTSIDE_LOAD_MAX = 0.15  # cores; a round counts as clean when neither side saw more
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True, "seed": 0}


def stages(model: str) -> list[dict[str, Any]]:
    return [
        {"name": "thinker", "type": "llm", "gpus": 0, "model": model, "engineArgs": ENGINE},
        {"name": "talker", "type": "llm", "gpus": 0, "model": model, "inputs": ["thinker"], "finalOutput": "text",
         "inputProcessor": "omnifleet_runtime.processors:llm_text", "engineArgs": ENGINE},
    ]


def control(fleet: C.Fleet, stage: str, method: str, args: dict) -> dict:
    status, body = fleet.post(f"/v1/stages/{stage}/control", {"method": method, "args": args, "timeout": 300})
    if status != 200:
        raise RuntimeError(f"control {method} on {stage}: HTTP {status}: {body}")
    (answer,) = body["replicas"].values()
    if not answer.get("ok"):
        raise RuntimeError(f"control {method} on {stage}: {answer}")
    return answer["result"]


def tree(pids: list[int]) -> list[int]:
    """The processes and all their descendants."""
    out: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += C.children(pid)
    return sorted(out)


def ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            f = C.proc_stat_fields(f"/proc/{pid}/stat")
            total += int(f[11]) + int(f[12])
        except (OSError, ValueError, IndexError):
            pass
    return total


def machine_busy() -> int:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4]  # all but idle and iowait


class OutsideLoad:
    """Cores the rest of the machine took while a side ran: machine busy time minus the fleet's and ours."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def __enter__(self) -> "OutsideLoad":
        self.t, self.m, self.p = time.perf_counter(), machine_busy(), ticks(self.pids)
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t
        others = (machine_busy() - self.m) - (ticks(self.pids) - self.p)
        self.cores = round(max(0.0, others / CLK_TCK / wall), 2)


class Workload:
    def __init__(self, concurrency: int, tokens: int):
        self.n, self.tokens = concurrency, tokens
        self.params = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
        self.prompts = [[{"role": "user", "content": f"Count: {i}, {i + 1}, {i + 2}"}] for i in range(concurrency)]

    def body(self, prompt: list) -> dict:
        return {"model": "bench", "messages": prompt, "return_token_ids": True,
                "stage_sampling_params": {"thinker": self.params, "talker": self.params}}

    def through_pipeline(self, fleet: C.Fleet) -> tuple[float, list[list[int]]]:
        results: list[Any] = [None] * self.n

        def call(i: int) -> None:
            results[i] = fleet.post("/v1/chat/completions", self.body(self.prompts[i]))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(self.n)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        took = time.perf_counter() - t
        ids = []
        for status, body in results:
            if status != 200:
                raise RuntimeError(f"pipeline request failed: HTTP {status}: {body}")
            ids.append(body["choices"][0]["token_ids"])
        return took, ids

    def direct(self, fleet: C.Fleet) -> tuple[float, float, list[list[int]]]:
        """(seconds inside the engines, wall seconds with the control round trips, talker token ids)."""
        t = time.perf_counter()
        d1 = control(fleet, "thinker", "generate", {"prompts": self.prompts, "sampling_params": self.params})
        d2 = control(fleet, "talker", "generate", {"prompts": [o["text"] for o in d1["outputs"]],
                                                   "sampling_params": self.params})
        wall = time.perf_counter() - t
        return d1["elapsed_s"] + d2["elapsed_s"], wall, [o["token_ids"] for o in d2["outputs"]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    w = Workload(args.concurrency, args.tokens)
    total = 2 * w.n * w.tokens
    rounds: list[dict[str, Any]] = []
    # Two CPU engines and the master share the cores here: a replica starved past the production 2 s of
    # silence is dropped mid-run (seen twice), which measures failover, not throughput. The tests' setting.
    with C.Fleet("vllm", stages(model), env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                 spec={"heartbeat": {"intervalSeconds": 0.5, "timeoutSeconds": 20}}) as fleet:
        t = time.perf_counter()
        fleet.start_master()
        fleet.start_pod("thinker-0", "thinker")
        fleet.start_pod("talker-0", "talker")
        fleet.wait_ready(timeout=args.start_timeout)
        start_s = time.perf_counter() - t
        C.log(f"fleet ready in {start_s:.0f} s")
        w.through_pipeline(fleet)  # warm both paths (first-request compilation, caches)
        w.direct(fleet)
        ours = tree([os.getpid(), *(p.pid for p in fleet.procs.values())])
        deadline = time.monotonic() + args.time_limit
        for rnd in range(1, args.rounds + 1):
            if time.monotonic() > deadline:
                C.log(f"time limit reached after {rnd - 1} rounds")
                break
            pipeline_first = rnd % 2 == 1
            r: dict[str, Any] = {"round": rnd, "order": "pipeline first" if pipeline_first else "direct first"}
            for side in (("pipeline", "direct") if pipeline_first else ("direct", "pipeline")):
                with OutsideLoad(ours) as load:
                    if side == "pipeline":
                        r["pipeline_s"], p_ids = w.through_pipeline(fleet)
                    else:
                        r["direct_engine_s"], r["direct_wall_s"], d_ids = w.direct(fleet)
                r[f"outside_load_cores_{side}"] = load.cores
            if p_ids != d_ids:
                raise RuntimeError(f"round {rnd}: the pipeline's talker tokens differ from the direct call's: "
                                   f"{p_ids} != {d_ids}")
            r["pipeline_tok_s"] = round(total / r["pipeline_s"], 1)
            r["direct_tok_s"] = round(total / r["direct_engine_s"], 1)
            r["ratio"] = round(r["direct_engine_s"] / r["pipeline_s"], 3)
            r["ratio_vs_direct_wall"] = round(r["direct_wall_s"] / r["pipeline_s"], 3)
            for k in ("pipeline_s", "direct_engine_s", "direct_wall_s"):
                r[k] = round(r[k], 3)
            r["clean"] = max(r["outside_load_cores_pipeline"], r["outside_load_cores_direct"]) <= OUTSIDE_LOAD_MAX
            C.log(f"round {rnd}: pipeline {r['pipeline_tok_s']} tok/s, direct {r['direct_tok_s']} tok/s, "
                  f"ratio {r['ratio']} ({r['order']}; outside load {r['outside_load_cores_pipeline']}/"
                  f"{r['outside_load_cores_direct']} cores)")
            rounds.append(r)
    return {"model": model, "engine_args": ENGINE, "concurrency": w.n, "tokens_per_stage": w.tokens,
            "tokens_per_round": total, "fleet_start_s": round(start_s, 1), "rounds": rounds}


def headline(res: dict[str, Any]) -> dict[str, Any]:
    everyone = res["rounds"]
    rs = [r for r in everyone if r["clean"]] or everyone
    return {
        "headline_rounds": (f"{len(rs)} of {len(everyone)} rounds clean (outside load <= {OUTSIDE_LOAD_MAX} "
                            "cores on both sides)" if rs is not everyone else
                            f"no clean round of {len(everyone)}: median of all"),
        "pipeline_over_direct_tok_s_all_rounds_median": round(C.pct([r["ratio"] for r in everyone], 50), 3),
        "outside_load_cores_rounds": [[r["outside_load_cores_pipeline"], r["outside_load_cores_direct"]]
                                      for r in everyone],
        "pipeline_over_direct_tok_s": round(C.pct([r["ratio"] for r in rs], 50), 3),
        "pipeline_over_direct_tok_s_rounds": [r["ratio"] for r in everyone],
        "pipeline_over_direct_wall_tok_s": round(C.pct([r["ratio_vs_direct_wall"] for r in rs], 50), 3),
        "pipeline_tok_s": round(C.pct([r["pipeline_tok_s"] for r in rs], 50), 1),
        "direct_tok_s": round(C.pct([r["direct_tok_s"] for r in rs], 50), 1),
        "rounds": len(everyone),
    }


def report(res: dict[str, Any], h: dict[str, Any], facts: dict[str, Any]) -> str:
    goal = goals.by_key("vllm_pipeline", "pipeline_over_direct_tok_s")
    rows = [[r["round"], r["order"], r["pipeline_tok_s"], r["direct_tok_s"], f"{r['ratio']:.3f}",
             f"{r['direct_wall_s']:.2f}", f"{r['outside_load_cores_pipeline']} / {r['outside_load_cores_direct']}",
             "yes" if r["clean"] else "no"] for r in res["rounds"]]
    return "\n".join([
        "# Two-stage vLLM pipeline vs the same engines called directly", "",
        __doc__.split("\n\n", 2)[2].strip(), "",
        f"{res['concurrency']} concurrent chats x ({res['tokens_per_stage']} thinker + {res['tokens_per_stage']} "
        f"talker tokens) per side per round; fleet start {res['fleet_start_s']} s.", "",
        f"**Headline: {h['pipeline_over_direct_tok_s']:.3f}x** ({h['headline_rounds']}; median of all "
        f"{h['rounds']} rounds {h['pipeline_over_direct_tok_s_all_rounds_median']:.3f}x; goal "
        f"{goal.text()}: {goal.verdict(h['pipeline_over_direct_tok_s'])}). Against the direct side's wall time "
        f"with its control round trips: {h['pipeline_over_direct_wall_tok_s']:.3f}x.", "",
        C.md_table(["round", "order", "pipeline tok/s", "direct tok/s (in the engines)", "ratio",
                    "direct wall s (with control RPCs)", "outside load, cores (pipeline / direct)", "clean"],
                   rows), "",
        C.facts_table(facts), "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256, help="tokens each stage generates per request")
    p.add_argument("--quick", action="store_true", help="3 rounds of 32 tokens; -quick files and latest key")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--time-limit", type=float, default=1800.0, help="no round starts after this many seconds")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = min(args.rounds, 3), 32
    facts = C.machine_facts()
    facts["command"] = " ".join([".venv/bin/python -m bench.vllm_pipeline", *(argv or [])])
    prov = C.provenance("vllm_pipeline")
    t0 = time.monotonic()
    res = run(args)
    if not res["rounds"]:
        C.log("no round completed")
        return 1
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    h = headline(res)
    stem = f"{C.today()}-vllm-pipeline" + ("-quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(report(res, h, facts))
    (args.out / f"{stem}.json").write_text(json.dumps({"facts": facts, "provenance": prov, **res, "headline": h},
                                                      indent=1) + "\n")
    C.merge_latest(args.out, "vllm_pipeline_quick" if args.quick else "vllm_pipeline",
                   {**h, "report": f"{stem}.md", "machine": C.machine_line(facts)}, prov)
    print(json.dumps(h, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raise SystemExit(main())
