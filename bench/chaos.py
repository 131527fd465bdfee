"""Chaos on real pods, recorded: runs tests/realnode/test_chaos.py and writes what it counted.

    .venv/bin/python -m bench.chaos [--seed 13]      # as root: the real node needs it; about 15 minutes

The scenario is the test's own (tests/realnode/chaos.py, one code path): a bounded load of 3
clients on the tiny vLLM pipeline while a seeded random pod (the master, a stage pod, an operator
pod) is deleted every 10 s for 2 minutes, then for 1 minute while both stages roll to a new revision;
then the node's kubelet, and then containerd, stopped for 30 s each under one client. The test
writes its counts (sent, succeeded, refused at connect, errors by kind, each kill, seconds from the
last kill to everything back and to each part back) to a file this reads; its pass/fail is recorded
beside them. Results: bench/results/<date>-chaos.{json,md} with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common as C

TEST = "tests/realnode/test_chaos.py"
SCENARIOS = {"pods": "a random pod deleted every 10 s for 2 min",
             "rollout": "a random pod deleted every 10 s for 1 min while both stages roll to a new revision",
             "kubelet": "the node's kubelet stopped for 30 s",
             "containerd": "the node's containerd stopped for 30 s"}


def run_test(seed: int, results: Path, log: Path) -> int:
    env = {**os.environ, "OMNIFLEET_CHAOS_SEED": str(seed), "OMNIFLEET_CHAOS_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join([str(C.ROOT / "runtime"), str(C.ROOT / "operator"), str(C.ROOT)])}
    with log.open("w") as out:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", TEST, "-p", "no:cacheprovider"],
                              cwd=C.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def report(res: dict[str, Any], facts: dict[str, Any], prov: dict[str, Any]) -> str:
    rows = []
    for key, what in SCENARIOS.items():
        r = res["scenarios"].get(key)
        if r is None:
            rows.append([what, "-", "-", "-", "-", "not reached"])
            continue
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"
        rows.append([what, r["sent"], r["succeeded"], r["refused_at_connect"], errors,
                     f"{r['seconds_from_last_kill_to_recovered']:g} s"])
    out = [f"# Chaos on real pods ({facts['date']})", "",
           f"`{facts['command']}`: the test {res['test']} (exit {res['exit_code']}), seed {res['seed']}, "
           f"commit {prov['commit'][:12]}{' (uncommitted: ' + ', '.join(prov['dirty']) + ')' if prov['dirty'] else ''}.",
           "", C.md_table(["scenario", "sent", "exact answers", "refused at connect", "errors (clear, by kind)",
                           "from the last kill (node: the restart) to all back"], rows), ""]
    pods = res["scenarios"].get("pods")
    if pods:
        out += ["Pods deleted (seconds since the load started):", "",
                ", ".join(f"{k['at']:g}s {k['component']}" for k in pods["kills"]), ""]
        examples = {**pods.get("examples", {})}
        if examples:
            out += ["One message per kind of error:", ""] + [f"- {k}: {v}" for k, v in examples.items()] + [""]
    out += ["Recovery means: the pipeline Ready, each of its Deployments and the operator's with every replica "
            "ready, no pod terminating, the master's /ready answering 200 and an operator replica holding the "
            "Lease (checked every second from the last kill, or the node process's restart, while the load "
            "still runs).", ""]
    parts = [f"- {SCENARIOS[key]}: {parts_line(r)}" for key, r in res["scenarios"].items()
             if key in SCENARIOS and "parts_back_s" in r]
    if parts:
        out += ["Each part's time back, in seconds from the last kill (node: the restart); what came back last is "
                "what recovery waited for:", "", *parts, ""]
    spans = [f"- {SCENARIOS.get(key, key)}: " + ", ".join(f"{pod} {a:g}-{b:g} s" for pod, (a, b) in
                                                         sorted(r["terminating_seen_s"].items(), key=lambda kv: kv[1]))
             for key, r in res["scenarios"].items() if r.get("terminating_seen_s")]
    if spans:
        out += ["Pods seen terminating (the first and last check that saw each, in seconds from the last kill):", "",
                *spans, ""]
    for key, r in res["scenarios"].items():
        for pod, seen in (r.get("lingering_pods") or {}).items():
            out += [f"{SCENARIOS.get(key, key)}: pod {pod} seen terminating for "
                    f"{seen['terminating_seen_s']:g} s; the end of its log:", "", "```", *seen["log_tail"], "```", ""]
    out += [C.facts_table(facts), ""]
    return "\n".join(out)


def parts_line(r: dict[str, Any]) -> str:
    back = sorted(r["parts_back_s"].items(), key=lambda kv: kv[1])
    done = ", ".join(f"{part} {t:g} s" for part, t in back)
    return (f"first check at {r['first_check_s']:g} s; every other part was back by then"
            + (f"; then {done}" if done else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=13, help="the pod picks' random seed (default: %(default)s)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    p.add_argument("--log", type=Path, help="keep the test's output here (default: a temporary file)")
    args = p.parse_args(argv)
    facts = C.machine_facts()
    facts["command"] = " ".join([".venv/bin/python -m bench.chaos", *(argv or [])])
    prov = C.provenance("chaos")
    with tempfile.TemporaryDirectory(prefix="omnifleet-chaos-") as tmp:
        results, log = Path(tmp) / "counts.json", args.log or Path(tmp) / "pytest.log"
        t0 = time.monotonic()
        C.log(f"running {TEST} (seed {args.seed}); its output: {log}")
        code = run_test(args.seed, results, log)
        scenarios = json.loads(results.read_text()) if results.exists() else {}
        tail = log.read_text()[-3000:]
    res = {"seed": args.seed, "exit_code": code, "test": "passed" if code == 0 else "failed",
           "elapsed_s": round(time.monotonic() - t0, 1), "scenarios": scenarios}
    if code:
        res["pytest_tail"] = tail
    stem = f"{C.today()}-chaos"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"facts": facts, "provenance": prov, **res}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(report(res, facts, prov))
    C.log(f"wrote {args.out / stem}.{{json,md}}; the test {res['test']}")
    return 0 if scenarios else 1


if __name__ == "__main__":
    raise SystemExit(main())
