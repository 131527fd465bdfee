"""CFG companions (a stage's promptExpand) through real stage processes: each companion runs beside its
request on the same replica, its output reaches the downstream stage as an input of its own, and a
failure or an abort of either ends both."""

from __future__ import annotations

import json

from fleet_harness import pipeline, stage, wait_until


def test_companions_run_on_the_requests_replica_and_reach_the_downstream_stage(make_fleet):
    fleet = make_fleet(pipeline(
        stage("src", "cfg_source", promptExpand="omnifleet_runtime.processors:negative_prompt",
              samplingParams={"k": 1}),
        stage("join", "render", inputs=["src"], inputProcessor="stagefns:cfg_join", inputMode="whole",
              finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-src-0", "src")
    fleet.start_pod("pod-src-1", "src")
    fleet.start_pod("pod-join", "join")
    fleet.wait_ready()
    client = fleet.openai()
    for _ in range(4):  # two replicas: every pair still lands on one
        out = client.completions.create(model="test", prompt="a red fox", extra_body={"negative_prompt": "blurry"})
        got = json.loads(out.choices[0].text)
        assert sorted(got) == ["src", "src:negative"], got
        own, neg = got["src"], got["src:negative"]
        assert own["text"] == "a red fox" and neg["text"] == "blurry"
        assert neg["rid"] == own["rid"] + "__negative"
        assert (neg["replica"], neg["pid"]) == (own["replica"], own["pid"])
        assert own["params"] == neg["params"] == {"k": 1}
        assert out.usage is None or out.usage.completion_tokens == 0

    # Without a negative prompt the stock expansion makes none: the join sees the request alone.
    got = json.loads(client.completions.create(model="test", prompt="plain").choices[0].text)
    assert list(got) == ["src"] and got["src"]["text"] == "plain"

    # Chat messages: the companion gets one user message with the negative prompt.
    chat = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"negative_prompt": "not this"})
    got = json.loads(chat.choices[0].message.content)
    assert got["src"]["text"] == "hi" and got["src:negative"]["text"] == "not this"

    # A companion the engine refuses fails the request with 400, naming the companion.
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "x", "negative_prompt": "refuse me"})
    assert status == 400 and "the 'negative' companion: cannot take 'refuse me'" in body["error"]["message"], body
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "x", "negative_prompt": 3})
    assert status == 400 and "'negative_prompt' must be a non-empty string" in body["error"]["message"]


def test_custom_expansion_overrides_params_and_a_streaming_stage_tells_companions_apart(make_fleet):
    fleet = make_fleet(pipeline(
        stage("src", "cfg_source", promptExpand="stagefns:expand_two", samplingParams={"k": 1}),
        stage("tags", "cfg_tags", inputs=["src"], finalOutput="text"),  # python: stream mode, no processor
    ))
    fleet.start_master()
    fleet.start_pod("pod-src", "src")
    fleet.start_pod("pod-tags", "tags")
    fleet.wait_ready()
    out = fleet.openai().completions.create(model="test", prompt="fox", extra_body={"negative_prompt": "n"})
    parts = out.choices[0].text.split("[")[1:]
    assert sorted(parts) == sorted(["own]pid,replica,rid", "own]params,text"]
                                   + [f"src:{r}]{k}" for r in ("negative", "plain")
                                      for k in ("pid,replica,rid", "params,text")]), parts
    # each run's chunks in its own order
    for who in ("own]", "src:negative]", "src:plain]"):
        mine = [p for p in parts if p.startswith(who)]
        assert mine == [who + "pid,replica,rid", who + "params,text"], parts


def test_a_pipeline_without_companions_refuses_a_negative_prompt(make_fleet):
    fleet = make_fleet(pipeline(stage("src", "source", finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-src", "src")
    fleet.wait_ready()
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "x", "negative_prompt": "blurry"})
    assert status == 400 and "no stage of this pipeline runs guidance companions" in body["error"]["message"]


def test_an_abort_ends_the_request_and_its_companion_in_the_engine(make_fleet):
    fleet = make_fleet(pipeline(
        stage("src", "cfg_held", promptExpand="omnifleet_runtime.processors:negative_prompt"),
        stage("join", "render", inputs=["src"], inputProcessor="stagefns:cfg_join", inputMode="whole",
              finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-src", "src")
    fleet.start_pod("pod-join", "join")
    fleet.wait_ready()
    # The companion holds; the request's deadline passes: the master aborts, the stage ends both runs.
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "go", "negative_prompt": "hold", "timeout": 5})
    assert status == 504, (status, body)
    wait_until(lambda: len(list(fleet.dir.glob("aborted-*"))) == 1, "the companion aborted", timeout=10)
    (held,) = [p.name for p in fleet.dir.glob("aborted-*")]
    assert held.endswith("__negative"), held
    # The one replica is free again: the next pair runs to the end.
    out = fleet.openai().completions.create(model="test", prompt="go", extra_body={"negative_prompt": "n"})
    assert sorted(json.loads(out.choices[0].text)) == ["src", "src:negative"]


async def test_an_engine_faster_than_the_stage_waits_for_it():
    """In process, with an engine of the stage's interface: chunks of a request and its companions made
    but not yet taken by the stage stay bounded, and every one still arrives, in order per run."""
    import asyncio

    from omnifleet_runtime import companions
    from omnifleet_runtime.engines import Engine, EngineRequest
    from omnifleet_runtime.wire import RequestInfo

    made: dict[str, int] = {}

    class Fast(Engine):
        async def generate(self, request: EngineRequest):
            async for _ in request.inputs:
                pass
            for i in range(200):
                made[request.request_id] = made.get(request.request_id, 0) + 1
                yield i

    def two(item, params, info):
        return [{"role": "negative", "input": "n"}, {"role": "extra", "input": "e"}]

    async def one_item():
        yield "p"

    got: dict[str, list[int]] = {}
    request = EngineRequest("r1", one_item(), {}, RequestInfo(request_id="r1", kind="completion", model="m"))
    taken = 0
    async for role, out in companions.run(Fast(), two, request):
        got.setdefault(role, []).append(out)
        taken += 1
        await asyncio.sleep(0)  # the stage sending on: every run gets to make chunks meanwhile
        assert sum(made.values()) - taken <= companions.QUEUE_CHUNKS + 3
    assert got == {"": list(range(200)), "negative": list(range(200)), "extra": list(range(200))}
