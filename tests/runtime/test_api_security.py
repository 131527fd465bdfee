"""The master's HTTP API refuses what it must: real master and stage processes, attacked over real sockets.

Request chat templates, bad types and oversized fields get 400 naming the
field before anything reaches a stage; the API key and the admin token are
checked; the admin endpoints are not on the client port; a request past its
deadline is aborted in its stage; a stage that wedges its event loop does not
take the next replica with it; a flood gets 429 with the master's memory
bounded; and a fuzz of every endpoint's body gets no 500, no crash, no hang.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet_harness import Fleet, pipeline, stage, wait_until
from omnifleet_runtime.api import TRANSCRIPTION_FIELDS
from omnifleet_runtime.limits import KNOWN_KEYS

from .test_chat_media import wav

CHAT = [{"role": "user", "content": "hi"}]


def with_master(doc: dict[str, Any], **master: Any) -> dict[str, Any]:
    doc["spec"]["master"] = master
    return doc


def start(make_fleet, doc: dict[str, Any], pods: dict[str, str], env: dict[str, str] | None = None) -> Fleet:
    fleet = make_fleet(doc)
    fleet.env.update(env or {})
    fleet.start_master()
    for pod, stage_name in pods.items():
        fleet.start_pod(pod, stage_name)
    fleet.wait_ready()
    return fleet


def error(fleet: Fleet, path: str, body: Any) -> tuple[int, str, str]:
    status, answer = fleet.http("POST", path, body)
    assert isinstance(answer, dict), answer
    return status, answer["error"]["type"], answer["error"]["message"]


def multi_output() -> dict[str, Any]:
    """An entry stage that echoes any JSON, and text, image and audio final stages after it."""
    return pipeline(
        stage("a", "any_json", gpus=0),
        stage("t", "any_json", inputs=["a"], finalOutput="text", gpus=0),
        stage("img", "tiny_image", inputs=["a"], finalOutput="image", gpus=0),
        stage("aud", "tiny_audio", inputs=["a"], finalOutput="audio", gpus=0),
        name="multi",
    )


# ---------------------------------------------------------------- input


def test_request_chat_template_is_refused_unless_the_pipeline_trusts_it(make_fleet):
    import openai

    fleet = start(make_fleet, pipeline(stage("a", "any_json", finalOutput="text")), {"pod-a": "a"})
    template = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
    prompt = {"messages": CHAT, "chat_template_kwargs": {"chat_template": template}}
    status, code, message = error(fleet, "/v1/completions", {"prompt": prompt})
    assert (status, code) == (400, "invalid_request_error")
    assert "'prompt.chat_template_kwargs.chat_template'" in message and "trustRequestChatTemplate" in message
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        fleet.openai().chat.completions.create(model="test", messages=CHAT, extra_body={"chat_template": template})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.chat_template"):
        fleet.openai().chat.completions.create(model="test", messages=CHAT,
                                               extra_body={"chat_template_kwargs": {"chat_template": template}})
    # apply_chat_template's own arguments are not template variables
    status, _, message = error(fleet, "/v1/chat/completions",
                               {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert status == 400 and "chat_template_kwargs.tokenize" in message
    assert fleet.metric("omnifleet_requests_total") == 0  # nothing was dispatched

    trusting = start(make_fleet, with_master(pipeline(stage("a", "any_json", finalOutput="text"), name="trusting"),
                                             trustRequestChatTemplate=True), {"pod-t": "a"})
    status, body = trusting.http("POST", "/v1/completions", {"model": "trusting", "prompt": prompt})
    assert status == 200 and "chat_template" in body["choices"][0]["text"]


def test_bad_types_and_oversized_fields_are_400_naming_the_field(make_fleet):
    doc = with_master(multi_output(), limits={"maxPromptChars": 1000, "maxTokens": 64, "maxN": 2,
                                              "maxMessages": 3, "maxImagePixels": 4096, "maxBodyBytes": 65536})
    fleet = start(make_fleet, doc, {"pod-a": "a", "pod-t": "t", "pod-i": "img", "pod-s": "aud"})
    cases = [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 65}, "'max_tokens' must be from 1 to 64"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": "9"},
         "'max_completion_tokens' must be an integer"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 3}, "'n' must be from 1 to 2"),
        ("/v1/chat/completions", {"messages": CHAT, "stage_sampling_params": {"t": {"max_tokens": 10**6}}},
         "'stage_sampling_params.t.max_tokens'"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "'temperature' must be a number"),
        ("/v1/chat/completions", {"messages": CHAT * 4}, "more than 3 messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1001}]}, "more than 1000 characters"),
        ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": 1, "content": "x"}]}, "'messages[0].role'"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "'stream' must be true or false"),
        ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": 1}}, "'stream_options'"),
        ("/v1/completions", {"prompt": "p", "stream_options": [True]}, "'stream_options' must be an object"),
        ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": 7}}, "audio.voice must be a non-empty string"),
        ("/v1/completions", {"prompt": "p", "audio": "aiden"}, "'audio' must be an object {voice}"),
        ("/v1/completions", {"prompt": "p", "audio": {"voice": "aiden", "format": "wav"}},
         "a completion's 'audio' takes only 'voice'"),
        ("/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, "'seed' must be from"),
        ("/v1/chat/completions", {"messages": CHAT, "sneaky": 1}, "unknown field 'sneaky'"),
        ("/v1/chat/completions", {"messages": CHAT, "timeout": 10**9}, "'timeout' must be a number of seconds"),
        ("/v1/completions", {"prompt": "p" * 1001}, "'prompt' is longer than 1000"),
        ("/v1/completions", {"prompt": {"prompt": "p", "sampling_params": {"n": 100}}}, "'prompt.sampling_params.n'"),
        ("/v1/completions", {"prompt": json.loads("[" * 40 + "1" + "]" * 40)}, "nested more than"),
        ("/v1/images/generations", {"prompt": "cat", "size": "65x64"}, "'size' 65x64 is more than 4096 pixels"),
        ("/v1/images/generations", {"prompt": "cat", "size": [1, 2]}, "'size' must be WIDTHxHEIGHT"),
        ("/v1/audio/speech", {"input": 42}, "'input' is required (a string)"),
    ]
    for path, body, expected in cases:
        status, code, message = error(fleet, path, body)
        assert (status, code) == (400, "invalid_request_error"), (body, message)
        assert expected in message, (body, message)
    for raw in (b"[1,", b"NaN", b'{"messages": 1e999}', b"\xff\xfe", b"[" * 60_000):
        req = urllib.request.Request(f"{fleet.url}/v1/chat/completions", data=raw, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400, raw[:20]
    status, _ = fleet.http("POST", "/v1/completions", {"prompt": "x" * 70_000})
    assert status == 413  # over maxBodyBytes: refused before it is parsed
    assert fleet.metric("omnifleet_requests_total") == 0
    # and what is within bounds is served, only known keys travelling to the stages
    status, body = fleet.http("POST", "/v1/images/generations", {"prompt": "cat", "size": "64x64", "n": 2})
    assert status == 200 and len(body["data"]) == 1  # tiny_image makes one 3x2 image whatever it is asked
    speech = fleet.openai().audio.speech.create(model="multi", voice="alloy", input="hello")
    assert speech.content[:4] == b"RIFF"


def test_a_request_past_its_deadline_is_aborted_in_its_stage(make_fleet):
    fleet = start(make_fleet, with_master(pipeline(stage("a", "until_aborted", finalOutput="text")),
                                          limits={"requestTimeoutSeconds": 60, "maxRequestTimeoutSeconds": 120}),
                  {"pod-a": "a"})
    status, code, message = error(fleet, "/v1/completions", {"prompt": "p", "timeout": 1})
    assert (status, code) == (504, "deadline_exceeded")
    assert "within its deadline of 1s" in message and "aborted in every stage" in message
    wait_until(lambda: any(p.name.startswith("cancelled-") for p in fleet.dir.iterdir()),
               "the stage to see its task cancelled by the master's Abort")
    assert fleet.metric("omnifleet_request_deadline_exceeded_total") == 1
    status, _, message = error(fleet, "/v1/completions", {"prompt": "p", "timeout": 121})
    assert status == 400 and "at most 120" in message


def test_a_stage_refusing_the_request_is_a_400_its_own_failure_a_500(make_fleet):
    fleet = start(make_fleet, pipeline(stage("a", "picky", finalOutput="text")), {"pod-a": "a"})
    status, code, message = error(fleet, "/v1/completions", {"prompt": "bad"})
    assert (status, code) == (400, "invalid_request_error")
    assert message == "stage 'a' refused the request: BadInput: this stage takes no 'bad' prompt"
    status, code, message = error(fleet, "/v1/completions", {"prompt": "boom"})
    assert (status, code) == (500, "stage_failed") and "RuntimeError: the stage broke" in message
    assert fleet.http("POST", "/v1/completions", {"prompt": "fine"})[1]["choices"][0]["text"] == "fine"


# ---------------------------------------------------------------- keys and tokens


def test_inference_endpoints_want_the_api_key(make_fleet):
    import openai

    fleet = start(make_fleet, pipeline(stage("a", "upper", finalOutput="text")), {"pod-a": "a"},
                  env={"OMNIFLEET_API_KEY": "s3cret-key"})
    with pytest.raises(openai.AuthenticationError):
        fleet.openai().chat.completions.create(model="test", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        fleet.openai(api_key="s3cret-kez").chat.completions.create(model="test", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        fleet.openai().models.list()
    out = fleet.openai(api_key="s3cret-key").chat.completions.create(model="test", messages=CHAT)
    assert out.choices[0].message.content == "HI"
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "p"})
    assert status == 401 and body["error"]["type"] == "unauthorized"
    assert fleet.get("/health")[0] == 200 and fleet.get("/ready")[0] == 200  # probes stay open


def test_control_without_the_admin_token_is_refused(make_fleet):
    fleet = start(make_fleet, pipeline(stage("a", "upper", finalOutput="text")), {"pod-a": "a"})
    ping = {"method": "ping"}
    # not on the client port at all
    assert fleet.http("POST", "/v1/stages/a/control", ping)[0] == 404
    assert fleet.get("/v1/stages")[0] == 404
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {fleet.admin_token}"},
                    {"Authorization": fleet.admin_token}):
        for method, path, body in (("POST", "/v1/stages/a/control", ping), ("GET", "/v1/stages", None)):
            status, answer = fleet.http(method, path, body, port=fleet.admin_port, headers=headers)
            assert status == 401 and answer["error"]["type"] == "unauthorized", (headers, path)
    status, body = fleet.control("a", ping)
    assert status == 200 and body["replicas"]["pod-a"]["result"]["pong"] is True
    # bounded calls: a finite, capped timeout; a method name, not anything
    for bad, expected in (({"method": "ping", "timeout": 0}, "'timeout'"),
                          ({"method": "ping", "timeout": 301}, "at most 300"),
                          ({"method": "ping", "timeout": "1"}, "'timeout'"), ({"method": "x" * 65}, "'method'"),
                          ({"method": "ping", "args": {"k": "v" * 70_000}}, "'args'"),
                          ({"method": "ping", "x": 1}, "unknown field")):
        status, body = fleet.control("a", bad)
        assert status == 400 and expected in body["error"]["message"], (bad, body)


def test_the_admin_api_is_off_without_a_token_and_llm_control_is_an_allow_list(make_fleet, tmp_path):
    from omnifleet_runtime.admin import Admin
    from omnifleet_runtime.limits import BadRequest
    from omnifleet_runtime.validate import load_pipeline

    fleet = make_fleet(pipeline(stage("a", "upper", finalOutput="text")))
    fleet.admin_token = ""
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    wait_until(lambda: (r := fleet.try_get("/ready")) is not None and r[0] == 200, "the pipeline to be ready")
    status, body = fleet.http("GET", "/v1/stages", port=fleet.admin_port, headers={"Authorization": "Bearer "})
    assert status == 403 and "no admin token is configured" in body["error"]["message"]
    # the allow-list of an llm stage, checked by the admin API before anything is sent (no process needed)
    doc = load_pipeline({"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "x"},
                 "spec": {"model": "m", "stages": [{"name": "llm", "type": "llm", "finalOutput": "text"}]}})
    admin = Admin(doc, orch=None, token="t")
    assert admin.check("llm", {"method": "sleep", "args": {"level": 1}}) == ("sleep", {"level": 1}, 10.0)
    for body, expected in (({"method": "collective_rpc"}, "not allowed on a llm stage"),
                           ({"method": "sleep", "args": {"level": 3}}, "'args.level'"),
                           ({"method": "stats", "args": {"x": 1}}, "unknown argument"),
                           ({"method": "generate", "args": {"prompts": ["p"] * 257}}, "'args.prompts'")):
        with pytest.raises(BadRequest, match=expected):
            admin.check("llm", body)


# ---------------------------------------------------------------- admission and wedged stages


def test_a_wedged_stage_does_not_wedge_the_next_replica(make_fleet):
    """The stage blocks its event loop on a "wedge" prompt: that request ends at its deadline, never
    re-dispatched, and the other replica keeps serving every other request."""
    doc = with_master(pipeline(stage("a", "wedge_on_request", finalOutput="text", replicas=2)),
                      limits={"requestTimeoutSeconds": 3})
    # The deadline (3 s) must come before the master drops the silent replica, or the request moves on.
    doc["spec"]["heartbeat"] = {"intervalSeconds": 0.5, "timeoutSeconds": 10}
    fleet = start(make_fleet, doc, {"pod-1": "a", "pod-2": "a"})
    status, code, message = error(fleet, "/v1/completions", {"prompt": "wedge"})
    assert (status, code) == (504, "deadline_exceeded"), message
    seen = {pod: (fleet.dir / f"seen-{pod}").read_text().split() if (fleet.dir / f"seen-{pod}").exists() else []
            for pod in ("pod-1", "pod-2")}
    (wedged,) = [pod for pod, prompts in seen.items() if "wedge" in prompts]
    (other,) = {"pod-1", "pod-2"} - {wedged}
    # the master stops routing to the silent replica (its heartbeats stopped)
    wait_until(lambda: [r["replica"] for r in fleet.stages()["a"]] == [other], "the wedged replica to be dropped",
               timeout=30)
    client = fleet.openai()
    for i in range(5):
        out = client.completions.create(model="test", prompt=f"after{i}")
        assert out.choices[0].text == f"after{i}@{other}"
    assert "wedge" not in (fleet.dir / f"seen-{other}").read_text().split()
    assert fleet.metric("omnifleet_redispatches_total") == 0


def test_re_dispatch_is_capped(make_fleet):
    """Without a short deadline, a request that wedges whatever runs it takes at most 1 + maxRedispatches
    replicas with it; the third keeps serving."""
    fleet = start(make_fleet, pipeline(stage("a", "wedge_on_request", finalOutput="text", replicas=3)),
                  {"pod-1": "a", "pod-2": "a", "pod-3": "a"})
    status, code, message = error(fleet, "/v1/completions", {"prompt": "wedge"})
    assert (status, code) == (502, "replica_lost") and "at most 1 re-dispatch" in message, message
    seen = {pod: (fleet.dir / f"seen-{pod}").read_text().split() if (fleet.dir / f"seen-{pod}").exists() else []
            for pod in ("pod-1", "pod-2", "pod-3")}
    wedged = [pod for pod, prompts in seen.items() if "wedge" in prompts]
    assert len(wedged) == 2, seen
    (spared,) = {"pod-1", "pod-2", "pod-3"} - set(wedged)
    wait_until(lambda: spared in {r["replica"] for r in fleet.stages()["a"]}, "the spared replica to be registered")
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "later"})
    assert status == 200 and body["choices"][0]["text"].startswith("later@")
    assert fleet.metric("omnifleet_redispatches_total") == 1


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_thousand_concurrent_requests_against_a_bound_of_100_get_429s(make_fleet):
    import aiohttp

    fleet = start(make_fleet, with_master(pipeline(stage("a", "gated_entry", finalOutput="text")),
                                          limits={"maxInflight": 100}), {"pod-a": "a"})
    master = fleet.procs["master"].pid
    status, _ = fleet.http("POST", "/v1/completions", {"prompt": "warm", "timeout": 0.5})  # warm the paths up
    assert status == 504
    before = rss_kib(master)

    async def flood() -> list[tuple[int, str | None]]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000), timeout=timeout) as http:
            async def one(i: int) -> tuple[int, str | None]:
                async with http.post(f"{fleet.url}/v1/completions", json={"prompt": f"p{i}"}) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")

            tasks = [asyncio.create_task(one(i)) for i in range(1000)]
            # the refused ones finish while the admitted ones wait at the stage's gate
            for _ in range(3000):
                if sum(t.done() for t in tasks) >= 900:
                    break
                await asyncio.sleep(0.02)
            (fleet.dir / "gate").touch()
            return await asyncio.gather(*tasks)

    results = asyncio.run(flood())
    statuses = [s for s, _ in results]
    refused = statuses.count(429)
    assert refused >= 900 and statuses.count(200) == 1000 - refused, sorted(set(statuses))
    assert all(retry == "1" for s, retry in results if s == 429)
    after = rss_kib(master)
    print(f"1000 concurrent requests, bound 100: {refused} refused with 429; master RSS {before} -> {after} KiB")
    assert after - before < 64 * 1024, f"the master grew from {before} KiB to {after} KiB"
    assert fleet.metric("omnifleet_requests_refused_total", reason="full") == refused


def test_a_client_trickling_its_body_holds_its_admission_slot_for_a_bounded_time(make_fleet):
    """With room for one request, a client that sends headers and then its body byte by byte (slowloris)
    blocks others only until the body read deadline (30 s), then gets 408."""
    import socket
    import time

    from omnifleet_runtime.api import BODY_READ_TIMEOUT_S

    fleet = start(make_fleet, with_master(pipeline(stage("a", "upper", finalOutput="text")),
                                          limits={"maxInflight": 1}), {"pod-a": "a"})
    slow = socket.create_connection(("127.0.0.1", fleet.api_port), timeout=BODY_READ_TIMEOUT_S + 30)
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        wait_until(lambda: fleet.http("POST", "/v1/completions", {"prompt": "p"})[0] == 429,
                   "the trickling client to hold the only slot")
        answer = slow.recv(4096)  # the master gives up on the body
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert time.monotonic() - t0 < BODY_READ_TIMEOUT_S + 10
    finally:
        slow.close()
    status, body = fleet.http("POST", "/v1/completions", {"prompt": "p"})
    assert status == 200 and body["choices"][0]["text"] == "P"


# ---------------------------------------------------------------- fuzz

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
TEXT = st.text(min_size=1, max_size=30)
# Values the API accepts (mostly), and beside each, any JSON.
GOOD = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=30)}), min_size=1, max_size=3),
    "prompt": TEXT, "input": TEXT, "model": st.sampled_from(["fuzz", "other"]), "stream": st.booleans(),
    "max_tokens": st.integers(-5, 40000), "n": st.integers(-1, 20), "temperature": st.floats(0, 2),
    "modalities": st.lists(st.sampled_from(["text", "audio", "image", "video"]), max_size=3),
    "stage_sampling_params": st.dictionaries(st.sampled_from(["a", "t", "img", "aud", "zz"]),
                                             st.dictionaries(st.text(max_size=8), JSON, max_size=3), max_size=3),
    "size": st.sampled_from(["auto", "2x3", "100000x100000", "x", "0x5"]),
    "response_format": st.sampled_from(["b64_json", "url", "wav", "pcm", "mp3"]),
    "stream_format": st.sampled_from(["audio", "sse", "x"]),
    "audio": st.fixed_dictionaries({"format": st.sampled_from(["wav", "pcm16", "mp3"])}),
    "timeout": st.floats(0.01, 5), "method": st.sampled_from(["ping", "whoami", "nosuch", ""]),
    "args": st.dictionaries(st.text(max_size=8), JSON, max_size=3), "return_token_ids": st.booleans(),
}
CORE = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/images/generations": "prompt",
        "/v1/audio/speech": "input", "/v1/stages/a/control": "method"}
ENDPOINTS = {
    "/v1/chat/completions": KNOWN_KEYS["chat"], "/v1/completions": KNOWN_KEYS["completion"],
    "/v1/images/generations": KNOWN_KEYS["image"], "/v1/audio/speech": KNOWN_KEYS["speech"],
    "/v1/stages/a/control": {"method", "args", "timeout"},
}


def post_status(url: str, data: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:  # a hang fails here
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def body_of(path: str) -> st.SearchStrategy:
    keys = sorted(ENDPOINTS[path])
    core = CORE[path]
    good = {k: GOOD[k] for k in keys if k in GOOD and k != core}
    noisy = {k: GOOD.get(k, JSON) | JSON for k in keys}
    return (st.fixed_dictionaries({core: GOOD[core]}, optional=good)  # mostly served
            | st.fixed_dictionaries({}, optional=noisy)  # mostly refused, field by field
            | st.dictionaries(st.text(max_size=12), JSON, max_size=4)
            | JSON)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_get_no_500_no_crash_no_hang(make_fleet, path):
    fleet = start(make_fleet, multi_output() | {"metadata": {"name": "fuzz"}},
                  {"pod-a": "a", "pod-t": "t", "pod-i": "img", "pod-s": "aud"})
    port = fleet.admin_port if "/stages/" in path else fleet.api_port
    headers = {"Authorization": f"Bearer {fleet.admin_token}"} if "/stages/" in path else {}
    statuses: set[int] = set()

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=body_of(path))
    def fuzz(body):
        status = post_status(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                             {"Content-Type": "application/json", **headers})
        statuses.add(status)
        assert status < 500 or status == 504, (status, body)

    fuzz()
    assert fleet.procs["master"].alive()
    assert fleet.get("/health")[0] == 200 and fleet.get("/ready")[0] == 200
    assert 200 in statuses and 400 in statuses, statuses  # both sides of the checks were reached


FORM_VALUE = st.text(max_size=20) | st.sampled_from(["json", "text", "srt", "en", "true", "false", "0.5", "nan",
                                                      "1e999", "fuzz", "-1"])
AUDIO_FILE = st.sampled_from([wav([0, 8000, -8000] * 100), b"RIFF" + bytes(40), b"fLaC", b"OggS\x00", b"ID3",
                              b"\xff\xfb\x90", b"", b"plain text"]) | st.binary(max_size=64)


def test_fuzzed_transcription_forms_get_no_500_no_crash_no_hang(make_fleet):
    """The multipart endpoint: any fields (known and not, repeated), any file bytes, or none."""
    from .test_transcriptions import multipart

    fleet = start(make_fleet, multi_output() | {"metadata": {"name": "fuzz"}},
                  {"pod-a": "a", "pod-t": "t", "pod-i": "img", "pod-s": "aud"})
    statuses: set[int] = set()
    keys = st.sampled_from(list(TRANSCRIPTION_FIELDS[1:])) | st.text(min_size=1, max_size=10).filter(
        lambda k: k.isprintable() and '"' not in k and "\\" not in k)

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(fields=st.dictionaries(keys, FORM_VALUE, max_size=5), file=st.none() | AUDIO_FILE,
           file_field=st.sampled_from(["file", "file", "prompt", "other"]))
    def fuzz(fields, file, file_field):
        data, ctype = multipart(fields | {"model": fields.get("model", "fuzz")},
                                {} if file is None else {file_field: ("clip.wav", file)})
        status = post_status(f"{fleet.url}/v1/audio/transcriptions", data, {"Content-Type": ctype})
        statuses.add(status)
        assert status < 500 or status == 504, (status, fields, file)

    fuzz()
    assert fleet.procs["master"].alive() and fleet.get("/health")[0] == 200
    assert 200 in statuses and 400 in statuses, statuses
