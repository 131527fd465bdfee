"""The README's benchmark table is what bench.readme renders from bench/results/latest.json; stale and
missed figures say so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import readme
from bench.goals import GOALS, MEASURES

from ..conftest import REPO, time_limit

TEST_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


def test_readme_table_is_what_bench_readme_renders_from_latest_json():
    latest = json.loads((REPO / "bench" / "results" / "latest.json").read_text())
    rendered = readme.render(latest, REPO)
    current = readme.current_block((REPO / "README.md").read_text())
    assert current == rendered, "README.md's benchmark table is out of date: run `python -m bench.readme`"


def test_every_latest_section_records_the_commit_and_date_it_measured():
    latest = json.loads((REPO / "bench" / "results" / "latest.json").read_text())
    for name, section in latest.items():
        prov = section.get("provenance")
        assert prov, f"latest.json[{name!r}] has no provenance"
        assert {"commit", "dirty", "date", "measures"} <= set(prov), (name, prov)
    assert {g.section for g in GOALS} - {"speech_ttfa"} <= set(MEASURES)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": str(repo), "PATH": "/usr/bin:/bin"}
                          ).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "commit", "-qm", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


def test_a_section_older_than_the_code_it_measures_is_stale(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, "runtime/omnifleet_runtime/wire.py", "v1")
    section = {"provenance": {"commit": measured, "dirty": [], "date": "d", "measures": []}}
    paths = ("runtime/omnifleet_runtime/wire.py",)
    assert readme.staleness(section, paths, tmp_path) is None
    _commit(tmp_path, "README.md", "unrelated")
    assert readme.staleness(section, paths, tmp_path) is None
    _commit(tmp_path, "runtime/omnifleet_runtime/wire.py", "v2")
    assert readme.staleness(section, paths, tmp_path) == "runtime/omnifleet_runtime/wire.py changed since"
    assert readme.staleness({"provenance": {"commit": None}}, paths, tmp_path) == "its run names no commit"


def test_the_table_says_misses_and_stale(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, "bench/vllm_pipeline.py", "v1")
    _commit(tmp_path, "runtime/omnifleet_runtime/stage.py", "v2")
    latest = {"vllm_pipeline": {"pipeline_over_direct_tok_s": 0.5, "pipeline_over_direct_tok_s_rounds": [0.4, 0.5, 0.6],
                                "report": "r.md", "provenance": {"commit": measured, "dirty": ["x.py"],
                                                                 "date": "2026-01-01", "measures": []}},
              "control_plane": {"op_peak_rss_mib_N1000": 200.0, "idle_writes_N10": 0, "idle_writes_N100": 2,
                                "timed_out_N100": True,
                                "provenance": {"commit": measured, "dirty": [], "date": "d", "measures": []}}}
    table = readme.render(latest, tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| two-stage vLLM"))
    assert "| 0.50x (median of 3 rounds; every round: 0.40x, 0.50x, 0.60x) |" in row
    assert row.endswith("| misses, stale |")
    assert "uncommitted changes to x.py" in row
    rss = next(line for line in table.splitlines() if line.startswith("| operator peak RSS"))
    assert rss.endswith("| meets |")  # control_plane measures no path this repo has changed
    idle = next(line for line in table.splitlines() if line.startswith("| operator writes on an idle"))
    assert "| 2 writes (N=10: 0 writes, N=100: 2 writes), in a round that timed out" in idle
    assert idle.endswith("| misses |")
    assert "- two-stage vLLM pipeline / the same engines called directly, tokens/s misses:" in table
    assert "`vllm_pipeline` is stale" in table
    missing = next(line for line in table.splitlines() if line.startswith("| operator / direct bulk apply"))
    assert "| not measured |" in missing
    late = next(line for line in table.splitlines() if line.startswith("| operator / direct bulk apply, time to all "
                                                                      "children, N=100 |"))
    assert "| timed out:" in late and late.endswith("| misses |")


def test_a_gpu_figure_names_the_card_it_was_measured_on():
    latest = json.loads((REPO / "bench" / "results" / "latest.json").read_text())
    card = latest["gpu_boundary"]["machine"].split(", ")[0]
    assert card.startswith("NVIDIA"), latest["gpu_boundary"]["machine"]
    table = readme.render(latest, REPO).splitlines()
    rows = [line for line in table if line.startswith("| ") and "GPU stages" in line]
    assert len(rows) == 2 and all(f", on {card}, " in row for row in rows), rows
    # the other sections do not name a machine there
    assert not any(", on " in line for line in table if line.startswith("| per hop"))
