"""How a stage ends its output on the wire: a callable that returns once (a python stage's function or
coroutine, a torch stage's forward) sends one chunk that says it is the last (no end message follows it:
one message a hop, not two); one that yields sends its chunks, then an end.

Real processes over real sockets: the master and stage `a` run as they do in a pod; the test plays stage
`b`, registered with the master under the pipeline's keys, so it sees each message `a` sends it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import constants as C
from omnifleet_runtime import security, wire
from omnifleet_runtime.config import config_hash, load_config, stage_revisions

QUIET_S = 1.0  # how long the test listens for anything after a stage's end


def play_b(fleet, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """Register as stage b (its data port a PULL of this test's); the control socket and the data socket.
    The context's authenticator must be running."""
    data = ctx.socket(zmq.PULL)
    data.linger = 0
    security.secure_server(data, fleet.keys, security.CURVE)
    port = data.bind_to_random_port("tcp://127.0.0.1")
    doc = load_config(str(fleet.config))
    ctl = fleet.control_peer(ctx)
    ctl.send_multipart(wire.encode(wire.Register(
        "b", "b-test", C.PROTOCOL_VERSION, config_hash(doc, "b"), f"tcp://127.0.0.1:{port}", engine="python",
        revision=stage_revisions(doc)["b"], generation=doc.metadata.generation or 0,
        revisions=stage_revisions(doc))))
    reply = next_msg(ctl, wire.RegisterReply)
    assert reply.ok, reply.reason
    ctl.send_multipart(wire.encode(wire.StageHeartbeat()))
    return ctl, data


def registered(fleet, name: str) -> bool:
    try:
        return bool(fleet.stages().get(name))
    except OSError:  # the master's admin port is not up yet
        return False


def next_msg(sock: zmq.Socket, kind: type, timeout_s: float = 10.0):
    """The next message of this kind (heartbeats and the like skipped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(left * 1000):
            msg = wire.decode(sock.recv_multipart())
            if isinstance(msg, kind):
                return msg
    raise AssertionError(f"no {kind.__name__} within {timeout_s:g}s")


def chunks_of_a(make_fleet, a: dict, prompt: str = "hop") -> tuple[list[wire.Data], str]:
    """What stage a sends b for one request, and the client's answer (b echoes a's chunks)."""
    fleet = make_fleet(pipeline(a, stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    # The test's b beats once: a comes up first (a torch stage imports torch), so b's silence stays short.
    wait_until(lambda: registered(fleet, "a"), "stage a to register", timeout=120)
    ctx = zmq.Context()
    auth = security.start_authenticator(ctx, fleet.keys)  # checks a's handshake on b's data port
    answer: dict[str, str] = {}
    try:
        ctl, data = play_b(fleet, ctx)
        fleet.wait_ready()
        caller = threading.Thread(target=lambda: answer.update(text=fleet.openai(timeout=30).completions.create(
            model="test", prompt=prompt).choices[0].text))
        caller.start()
        dispatch = next_msg(ctl, wire.Dispatch)
        got = [next_msg(data, wire.Data)]
        while not (got[-1].eof or got[-1].last):
            got.append(next_msg(data, wire.Data))
        deadline = time.monotonic() + QUIET_S
        while (left := deadline - time.monotonic()) > 0:  # nothing may follow a stage's end
            if data.poll(left * 1000):
                got.append(wire.decode(data.recv_multipart()))
        text = "".join(str(d.payload) for d in got if not d.eof)
        ctl.send_multipart(wire.encode(wire.Output(dispatch.request_id, dispatch.attempt, "b", 0, text)))
        ctl.send_multipart(wire.encode(wire.Done(dispatch.request_id, dispatch.attempt, "b", 1)))
        caller.join(30)
    finally:
        auth.stop()
        ctx.destroy(linger=0)
    return got, answer.get("text", "")


@pytest.mark.parametrize("fn", ["upper", "kind_async"])
def test_a_callable_that_returns_once_ends_with_its_chunk(make_fleet, fn):
    got, text = chunks_of_a(make_fleet, stage("a", fn))
    assert [(d.seq, d.last, d.eof) for d in got] == [(0, True, False)], got
    assert "hop" in text.lower()


def test_a_torch_forward_ends_with_its_chunk(make_fleet):
    fill = {"name": "a", "type": "torch", "entrypoint": "bench.torch_stages:make_fill", "engineArgs": {"device": "cpu"}}
    got, _ = chunks_of_a(make_fleet, fill, json.dumps({"n": 8, "v": 1.5}))
    assert [(d.seq, d.last, d.eof) for d in got] == [(0, True, False)], got
    assert isinstance(got[0].payload["x"], wire.Array), got[0].payload


def test_a_generator_ends_with_an_end_message_after_its_chunks(make_fleet):
    got, text = chunks_of_a(make_fleet, stage("a", "kind_agen"))
    assert [(d.seq, d.last, d.eof) for d in got] == [(0, False, False), (1, False, False), (2, False, False),
                                                     (3, False, True)], got
    assert text == "hop"
