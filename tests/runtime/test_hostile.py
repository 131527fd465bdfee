"""Garbage on the sockets and foreign protocol versions: refused with reasons, serving goes on."""

from __future__ import annotations

import msgspec
import zmq

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import constants as C
from omnifleet_runtime import wire

GARBAGE = [
    [b""],
    [b"\xc1\xc1\xc1"],
    [b"\x00" * 5000, b"x"],
    [b"\x80\x02cos\nsystem\n(S'touch /tmp/pwned'\ntR."],  # a pickle never gets unpickled
    [msgspec.msgpack.encode({"t": "Data", "request_id": 1})],
    [msgspec.msgpack.encode({"t": "Output", "request_id": "r", "attempt": 0, "stage": "s", "seq": 0,
                             "payload": msgspec.msgpack.Ext(1, msgspec.msgpack.encode([7]))})],
    wire.encode(wire.Done("nope", 0, "a", 0)),  # well-formed, from a connection that never registered
    wire.encode(wire.Dispatch("r", 0, "a", wire.RequestInfo("r", "completion", "m"), {}, [], [], True)),
]


def fleet_with(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()
    return fleet


def register(ctl: zmq.Socket, **fields) -> wire.RegisterReply:
    msg = {"stage": "a", "replica": "intruder", "protocol_version": C.PROTOCOL_VERSION, "config_hash": "x",
           "data_addr": "tcp://127.0.0.1:1", **fields}
    ctl.send_multipart(wire.encode(wire.Register(**msg)))
    assert ctl.poll(10_000), "no answer to a registration"
    return wire.decode(ctl.recv_multipart())


def test_garbage_frames_do_not_stop_master_or_stages(make_fleet):
    fleet = fleet_with(make_fleet)
    data_addr = fleet.stages()["b"][0]["data_addr"]
    ctx = zmq.Context()
    try:
        ctl = fleet.control_peer(ctx)  # keyed: garbage from one of the pipeline's own pods
        push = fleet.data_peer(ctx, data_addr)
        for frames in GARBAGE:
            ctl.send_multipart(frames)
            push.send_multipart(frames)
        # Data for a request nobody dispatched, and an eof from a stage that is no input.
        push.send_multipart(wire.encode(wire.Data("ghost", 0, "zz", 0, b"y" * 5000)))
        assert ctl.poll(10_000)  # the master answered the unregistered Done with a Reset
        assert isinstance(wire.decode(ctl.recv_multipart()), wire.Reset)
    finally:
        ctx.destroy(linger=5000)  # deliver what is still queued (PUSH has no reply to wait for)

    wait_until(lambda: fleet.metric("omnifleet_rejected_frames_total") >= 6, "the master to reject the garbage")
    wait_until(lambda: fleet.procs["pod-b"].output().count("rejected frame on the data port") >= 6,
               "stage b to reject the garbage")
    assert "rejected frame from" in fleet.procs["master"].output()
    assert fleet.openai().completions.create(model="test", prompt="still").choices[0].text == "STILL!"
    assert all(p.alive() for p in fleet.procs.values())


def test_wrong_protocol_version_and_config_are_refused(make_fleet):
    fleet = fleet_with(make_fleet)
    ctx = zmq.Context()
    try:
        ctl = fleet.control_peer(ctx)
        reply = register(ctl, protocol_version=C.PROTOCOL_VERSION + 1)
        assert not reply.ok
        assert reply.reason == (f"protocol version mismatch: the stage speaks version {C.PROTOCOL_VERSION + 1}, "
                                f"this master speaks version {C.PROTOCOL_VERSION}")
        # A future version whose Register no longer decodes as ours still gets the clear refusal.
        ctl.send_multipart([msgspec.msgpack.encode({"t": "Register", "protocol_version": 7, "stage": {"x": 1}})])
        assert ctl.poll(10_000)
        assert "the stage speaks version 7" in wire.decode(ctl.recv_multipart()).reason

        reply = register(ctl, config_hash="0" * 64)
        assert not reply.ok and reply.reason.startswith("config hash mismatch")
        reply = register(ctl, stage="nosuch")
        assert not reply.ok and "no stage 'nosuch'" in reply.reason
    finally:
        ctx.destroy(linger=0)
    assert [r["replica"] for r in fleet.stages()["a"]] == ["pod-a"]
    assert "protocol version mismatch" in fleet.procs["master"].output()
