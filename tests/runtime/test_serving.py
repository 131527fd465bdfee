"""Serving through the HTTP API with real master and stage processes."""

from __future__ import annotations

import http.client
import json
import signal
import threading

import openai
import pytest

from fleet_harness import pipeline, stage, wait_until


def chain_pipeline():
    return pipeline(
        stage("a", "upper"),
        stage("b", "exclaim", inputs=["a"], replicas=2, samplingParams={"suffix": "!"}),
        stage("c", "halves", inputs=["b"], finalOutput="text"),
    )


def test_three_stage_chain_with_openai_client(make_fleet):
    fleet = make_fleet(chain_pipeline())
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b1", "b")
    fleet.start_pod("pod-b2", "b")
    fleet.start_pod("pod-c", "c")
    fleet.wait_ready()
    client = fleet.openai()

    chat = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.content == "HELLO!"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "stop"

    stream = client.chat.completions.create(
        model="test", messages=[{"role": "user", "content": "omni"}], stream=True
    )
    deltas = [c.choices[0].delta.content for c in stream]
    assert [d for d in deltas if d] == ["OM", "NI!"]  # the two chunks the final stage yielded, in order

    done = client.completions.create(model="test", prompt="fleet")
    assert done.choices[0].text == "FLEET!"
    chunks = [c.choices[0].text for c in client.completions.create(model="test", prompt="abcd", stream=True)]
    assert "".join(chunks) == "ABCD!" and chunks[:2] == ["AB", "CD!"]

    # The per-request override of a stage's sampling params reaches that stage.
    over = client.completions.create(model="test", prompt="x", extra_body={"stage_sampling_params": {"b": {"suffix": "?"}}})
    assert over.choices[0].text == "X?"

    assert [m.id for m in client.models.list().data] == ["test"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="no stage of this pipeline"):
        client.completions.create(model="test", prompt="x", extra_body={"stage_sampling_params": {"zz": {}}})

    assert fleet.metric("omnifleet_stage_latency_seconds_count", stage="b") == 5
    assert fleet.metric("omnifleet_requests_total", outcome="ok") == 5
    # Both replicas of b took work (least outstanding, ties take turns).
    wait_until(lambda: all(fleet.metric("omnifleet_stage_bytes_total", stage="b", replica=r, path="tcp") > 0
                           for r in ("pod-b1", "pod-b2")), "both replicas of b to report work")
    assert fleet.get("/health") == (200, {"status": "ok"})
    assert fleet.get("/ready") == (200, {"ready": True, "stages": {
        "a": {"registered": 1, "routable": 1}, "b": {"registered": 2, "routable": 2},
        "c": {"registered": 1, "routable": 1}}})
    metrics = fleet.get("/metrics")[1]
    for name in ("omnifleet_stage_inflight{", "omnifleet_stage_queue_depth{", "omnifleet_stage_bytes_total{",
                 "omnifleet_request_latency_seconds_bucket", "omnifleet_stage_latency_seconds_bucket"):
        assert name in metrics
    assert fleet.metric("omnifleet_stage_replicas", stage="b") == 2

    # Control RPCs reach every replica of a stage and return each answer.
    status, body = fleet.control("b", {"method": "ping"})
    assert status == 200 and sorted(body["replicas"]) == ["pod-b1", "pod-b2"]
    assert all(a["ok"] and a["result"]["pong"] for a in body["replicas"].values())
    status, body = fleet.control("b", {"method": "whoami", "args": {"k": 1}})
    assert {r: a["result"]["pod"] for r, a in body["replicas"].items()} == {"pod-b1": "pod-b1", "pod-b2": "pod-b2"}
    status, body = fleet.control("b", {"method": "nosuch"})
    assert all(not a["ok"] and "nosuch" in a["error"] for a in body["replicas"].values())
    assert fleet.control("zz", {"method": "ping"})[0] == 404


def test_fan_out_fan_in_and_sampling_overrides(make_fleet):
    fleet = make_fleet(pipeline(
        stage("src", "source"),
        stage("left", "describe", inputs=["src"], samplingParams={"temperature": 0.5, "k": 1}),
        stage("right", "describe", inputs=["src"], samplingParams={"temperature": 0.9}),
        stage("join", "render", inputs=["left", "right"], inputProcessor="stagefns:join_inputs",
              inputMode="whole", finalOutput="text"),
    ))
    fleet.start_master()
    for s in ("src", "left", "right", "join"):
        fleet.start_pod(f"pod-{s}", s)
    fleet.wait_ready()

    out = fleet.openai().completions.create(
        model="test", prompt="hi", temperature=0.1,  # top-level params go to the entry stage
        extra_body={"stage_sampling_params": {"left": {"k": 7}}},
    )
    assert json.loads(out.choices[0].text) == {
        "left": {"stage": "left", "text": "hi", "params": {"temperature": 0.5, "k": 7}},
        "right": {"stage": "right", "text": "hi", "params": {"temperature": 0.9}},
    }


def test_fan_in_of_streaming_stages_tells_its_inputs_apart(make_fleet):
    """A python join (stream mode by default) with two inputs and no input processor gets {upstream: chunk}."""
    fleet = make_fleet(pipeline(
        stage("src", "source"),
        stage("left", "describe", inputs=["src"]),
        stage("right", "describe", inputs=["src"]),
        stage("join", "tag_source", inputs=["left", "right"], finalOutput="text"),
    ))
    fleet.start_master()
    for s in ("src", "left", "right", "join"):
        fleet.start_pod(f"pod-{s}", s)
    fleet.wait_ready()
    out = fleet.openai().completions.create(model="test", prompt="hi")
    # one output chunk per upstream chunk, in arrival order
    assert out.choices[0].text in ("left=hiright=hi", "right=hileft=hi"), out.choices[0].text


def test_downstream_starts_on_upstream_chunks(make_fleet):
    """The first audio-like chunk reaches the client while the upstream is still generating."""
    fleet = make_fleet(pipeline(
        stage("talker", "slow_source"),
        stage("vocoder", "bracket", inputs=["talker"], finalOutput="text"),  # python: stream mode
    ))
    fleet.start_master()
    fleet.start_pod("pod-t", "talker")
    fleet.start_pod("pod-v", "vocoder")
    fleet.wait_ready()

    texts, upstream_done_at_first = [], None
    stream = fleet.openai().completions.create(model="test", prompt="x", stream=True)
    for chunk in stream:
        if chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
        if len(texts) == 1 and upstream_done_at_first is None:
            upstream_done_at_first = (fleet.dir / "upstream-done").exists()
            (fleet.dir / "go").touch()  # only now may the upstream produce its second chunk
    assert texts == ["<first>", "<second>"]
    assert upstream_done_at_first is False  # the first output came while the upstream was generating
    assert (fleet.dir / "upstream-done").exists()


def test_client_disconnect_aborts_every_stage(make_fleet):
    fleet = make_fleet(pipeline(
        stage("a", "abortable"),
        stage("b", "abortable", inputs=["a"], finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()

    conn = http.client.HTTPConnection("127.0.0.1", fleet.api_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "test", "prompt": "x", "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = next(line for line in iter(resp.readline, b"") if line.startswith(b"data:"))
    assert json.loads(first[5:])["choices"][0]["text"] == "tick"
    conn.close()  # the client goes away while both stages wait on the gate
    wait_until(lambda: (fleet.dir / "aborted-a").exists() and (fleet.dir / "aborted-b").exists(),
               "both stages to see the abort")
    wait_until(lambda: all(r["inflight"] == 0 for rs in fleet.stages().values() for r in rs),
               "the master to release the request")
    assert fleet.metric("omnifleet_requests_total", outcome="aborted") == 1


def test_no_replica_gives_503_and_waiting_requests_survive(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "gated_entry"), stage("b", "echo", inputs=["a"], finalOutput="text")))
    fleet.start_master("--replica-wait-timeout", "60")
    fleet.start_pod("pod-a", "a")
    wait_until(lambda: fleet.try_get("/ready") and fleet.get("/ready")[1].get("missing_stages") == ["b"],
               "/ready to name the missing stage")
    status, body = fleet.get("/ready")
    assert status == 503 and "b" in body["message"]
    with pytest.raises(openai.InternalServerError) as err:
        fleet.openai().completions.create(model="test", prompt="x")
    assert err.value.status_code == 503 and "stage(s) b" in err.value.message

    fleet.start_pod("pod-b1", "b")
    fleet.wait_ready()
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault(
        "out", fleet.openai().completions.create(model="test", prompt="kept")))
    waiter.start()
    wait_until(lambda: list(fleet.dir.glob("started-*")), "the request to reach stage a")
    fleet.procs["pod-b1"].signal_group(signal.SIGKILL)  # b's only replica dies while the request is in a
    wait_until(lambda: fleet.get("/ready")[0] == 503, "the master to notice")
    fleet.start_pod("pod-b2", "b")
    fleet.wait_ready()
    (fleet.dir / "gate").touch()
    waiter.join(timeout=30)
    assert result["out"].choices[0].text == "kept@pod-a"


def test_usage_counts_the_tokens_each_stage_reports(make_fleet):
    """usage: the entry stage's prompt tokens, the final stage's completion tokens, and every stage's own;
    streamed as OpenAI does when stream_options.include_usage asks (a last chunk without choices)."""
    fleet = make_fleet(pipeline(stage("a", "counted_entry"), stage("b", "counted_final", inputs=["a"],
                                                                     finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()
    want = {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
            "stages": {"a": {"prompt_tokens": 3, "completion_tokens": 6}, "b": {"prompt_tokens": 0,
                                                                                "completion_tokens": 6}}}
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "one two three"})
    assert status == 200 and body["choices"][0]["text"] == "t0t1t2" and body["usage"] == want, body
    client = fleet.openai()
    chat = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "one two three"}])
    assert chat.usage.prompt_tokens == 3 and chat.usage.completion_tokens == 6 and chat.usage.total_tokens == 9
    chunks = list(client.chat.completions.create(model="test", messages=[{"role": "user", "content": "a b c"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump()["stages"] == want["stages"] and chunks[-1].usage.total_tokens == 9
    plain = list(client.chat.completions.create(model="test", messages=[{"role": "user", "content": "a b c"}],
                                                stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "stop"

    # n choices: n runs of the pipeline, one choice each, usage summed
    two = client.completions.create(model="test", prompt="one two three", n=2)
    assert [(c.index, c.text) for c in two.choices] == [(0, "t0t1t2"), (1, "t0t1t2")]
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (6, 12)
    assert two.usage.model_dump()["stages"]["b"] == {"prompt_tokens": 0, "completion_tokens": 12}
    chunks = list(client.chat.completions.create(model="test", messages=[{"role": "user", "content": "a b c"}],
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    by_index: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert by_index == {0: "t0t1t2", 1: "t0t1t2"} and len({c.id for c in chunks}) == 1
    assert sum(1 for c in chunks[:-1] if c.choices[0].finish_reason == "stop") == 2
    assert chunks[-1].usage.total_tokens == 18
