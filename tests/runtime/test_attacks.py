"""Attacks on the wire, as a process on the pod network would try them: each is refused.

Real processes over real sockets. "Unkeyed" peers know everything the
ConfigMap holds (stage names, the routing hash, the server's public key) but
not the pipeline's client secret key; "keyed" peers hold the keys, as a
compromised pod of the pipeline would.
"""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import constants as C
from omnifleet_runtime import seal, wire
from omnifleet_runtime.config import config_hash, load_config

QUIET_S = 3.0  # how long an attacker listens for anything at all


def two_stages(make_fleet, *, master_extra=(), pod_extra=(), **spec):
    doc = pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text"))
    doc["spec"].update(spec)
    fleet = make_fleet(doc)
    fleet.start_master(*master_extra)
    fleet.start_pod("pod-a", "a", extra=tuple(pod_extra))
    fleet.start_pod("pod-b", "b", extra=tuple(pod_extra))
    fleet.wait_ready()
    return fleet


def register_msg(fleet, stage_name="a", replica="intruder", data_addr="tcp://127.0.0.1:1") -> list:
    doc = load_config(str(fleet.config))
    return wire.encode(wire.Register(stage_name, replica, C.PROTOCOL_VERSION, config_hash(doc, stage_name),
                                     data_addr))


def received_within(sock: zmq.Socket, seconds: float) -> list:
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(left * 1000):
            got.append(sock.recv_multipart())
    return got


def try_send(sock: zmq.Socket, frames: list) -> None:
    """Send if ZMQ queues it; a socket whose handshake failed has nowhere to queue (it would block)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def foreign_keyed(ctx: zmq.Context, fleet, kind: int) -> zmq.Socket:
    """A peer with a CURVE keypair of its own and the pipeline's server key (public, in the pods)."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = fleet.keys.server_public
    return sock


def test_an_unkeyed_peer_registering_as_a_stage_gets_nothing(make_fleet):
    fleet = two_stages(make_fleet)
    ctx = zmq.Context()
    try:
        plain = fleet.control_peer(ctx, keyed=False)
        foreign = foreign_keyed(ctx, fleet, zmq.DEALER)
        foreign.connect(f"tcp://127.0.0.1:{fleet.control_port}")
        for sock in (plain, foreign):
            try_send(sock, register_msg(fleet))  # the right routing hash: it is in the ConfigMap
        # Requests flow meanwhile: none of them is dispatched to the intruders.
        for i in range(3):
            assert fleet.openai().completions.create(model="test", prompt=f"hi {i}").choices[0].text == f"HI {i}!"
        assert received_within(plain, QUIET_S) == []
        assert received_within(foreign, 0.1) == []
    finally:
        ctx.destroy(linger=0)
    assert [r["replica"] for r in fleet.stages()["a"]] == ["pod-a"]
    wait_until(lambda: fleet.metric("omnifleet_auth_refused_total") >= 1, "the foreign key to be counted")
    assert "intruder" not in fleet.procs["master"].output()


def test_a_keyed_peer_cannot_take_over_a_live_replica_or_point_data_elsewhere(make_fleet):
    fleet = two_stages(make_fleet)
    before = fleet.stages()["a"][0]
    ctx = zmq.Context()
    try:
        ctl = fleet.control_peer(ctx)
        ctl.send_multipart(register_msg(fleet, replica="pod-a", data_addr="tcp://127.0.0.1:9"))
        assert ctl.poll(10_000)
        reply = wire.decode(ctl.recv_multipart())
        assert not reply.ok
        assert reply.reason.startswith("replica a/pod-a is already registered from another live connection")

        other = fleet.control_peer(ctx)
        other.send_multipart(register_msg(fleet, replica="pod-x", data_addr="tcp://127.0.0.2:5580"))
        assert other.poll(10_000)
        reply = wire.decode(other.recv_multipart())
        assert not reply.ok
        assert reply.reason == "data address tcp://127.0.0.2:5580 is not on this connection's peer address 127.0.0.1"
    finally:
        ctx.destroy(linger=0)
    after = fleet.stages()["a"]
    assert [(r["replica"], r["data_addr"]) for r in after] == [(before["replica"], before["data_addr"])]
    assert fleet.openai().completions.create(model="test", prompt="still").choices[0].text == "STILL!"
    assert fleet.metric("omnifleet_refused_registrations_total", stage="a") == 2


def test_membership_of_a_stage_is_bounded(make_fleet):
    fleet = two_stages(make_fleet)
    ctx = zmq.Context()
    try:
        socks = [fleet.control_peer(ctx) for _ in range(C.MIN_REPLICAS_BOUND)]
        replies = []
        for i, sock in enumerate(socks):  # pod-a holds one place already
            sock.send_multipart(register_msg(fleet, replica=f"flood-{i}"))
        for sock in socks:
            assert sock.poll(10_000)
            replies.append(wire.decode(sock.recv_multipart()))
    finally:
        ctx.destroy(linger=0)
    assert sum(r.ok for r in replies) == C.MIN_REPLICAS_BOUND - 1
    refused = [r.reason for r in replies if not r.ok]
    assert refused == [f"stage 'a' already has {C.MIN_REPLICAS_BOUND} registered replicas (the bound)"]


def test_a_data_port_peer_without_keys_reaches_no_decoder(make_fleet):
    fleet = two_stages(make_fleet)
    data_addr = fleet.stages()["b"][0]["data_addr"]
    forged = [wire.encode(wire.Data("ghost", 0, "zz", 0, b"y" * 5000)), [b"\xc1garbage"]]
    ctx = zmq.Context()
    try:
        foreign = foreign_keyed(ctx, fleet, zmq.PUSH)
        foreign.connect(data_addr)
        for sock in (fleet.data_peer(ctx, data_addr, keyed=False), foreign):
            for frames in forged:
                try_send(sock, frames)
        time.sleep(QUIET_S)
        log = fleet.procs["pod-b"].output()
        assert "rejected frame on the data port" not in log and "ignored data" not in log
        # The control: the same bytes from a keyed peer do reach the decoder (and are rejected there).
        keyed = fleet.data_peer(ctx, data_addr)
        keyed.send_multipart([b"\xc1garbage"])
        wait_until(lambda: "rejected frame on the data port" in fleet.procs["pod-b"].output(),
                   "the keyed peer's garbage to reach the decoder")
    finally:
        ctx.destroy(linger=0)
    assert fleet.openai().completions.create(model="test", prompt="ok").choices[0].text == "OK!"


def test_plain_auth_data_plane_serves_and_refuses_a_wrong_token(make_fleet):
    fleet = two_stages(make_fleet, security={"dataPlane": "plain-auth"})
    assert fleet.openai().completions.create(model="test", prompt="plain").choices[0].text == "PLAIN!"
    data_addr = fleet.stages()["b"][0]["data_addr"]
    ctx = zmq.Context()
    try:
        wrong = ctx.socket(zmq.PUSH)
        wrong.linger = 0
        wrong.plain_username, wrong.plain_password = b"omnifleet", b"not-the-token-of-this-pipeline"
        wrong.connect(data_addr)
        curve = fleet.data_peer(ctx, data_addr)  # a CURVE client: not the mechanism of this port
        for sock in (wrong, curve):
            try_send(sock, [b"\xc1garbage"])
        time.sleep(QUIET_S)
        assert "rejected frame on the data port" not in fleet.procs["pod-b"].output()
        right = ctx.socket(zmq.PUSH)
        right.linger = 0
        right.plain_username, right.plain_password = b"omnifleet", fleet.keys.token
        right.connect(data_addr)
        right.send_multipart([b"\xc1garbage"])
        wait_until(lambda: "rejected frame on the data port" in fleet.procs["pod-b"].output(),
                   "the right token's garbage to reach the decoder")
    finally:
        ctx.destroy(linger=0)


def test_bulk_port_opens_nothing_without_its_message_key(make_fleet):
    """The bulk port (a `curve` pipeline's sealed large messages) is unencrypted ZMQ PLAIN: a sniffer may
    learn its token. Even with it, a part nobody announced over CurveZMQ is only held, then dropped; and a
    part whose key a keyed peer announces, but that was not sealed under it, does not open."""
    fleet = two_stages(make_fleet)  # the default data plane: curve
    b = fleet.stages()["b"][0]
    assert b["bulk_addr"] and b["bulk_addr"] != b["data_addr"]
    key = os.urandom(16)
    ctx = zmq.Context()
    try:
        for token in (b"not-the-token-of-this-pipeline", fleet.keys.token):
            sock = ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.plain_username, sock.plain_password = b"omnifleet", token
            sock.connect(b["bulk_addr"])
            try_send(sock, [seal.BULK_MAGIC + key + b"\x00\x00", os.urandom(seal.SEAL_MIN_BYTES + seal.TAG)])
            try_send(sock, [b"\xc1garbage"])
        wait_until(lambda: "not a sealed part" in fleet.procs["pod-b"].output(), "the token's garbage to be refused")
        time.sleep(QUIET_S)
        log = fleet.procs["pod-b"].output()
        assert "does not open" not in log and "ignored data" not in log  # the forged part is held, unopened
        # A keyed peer (a compromised pod) announces that key with a secret of its own: the part still fails.
        announce = seal.Announce(key, os.urandom(32), [seal.SEAL_MIN_BYTES], [[(0, 0)]])
        keyed = fleet.data_peer(ctx, b["data_addr"])  # kept: a socket collected is closed unsent (linger 0)
        keyed.send_multipart([seal.ANNOUNCE_MAGIC + msgspec.msgpack.encode(announce)])
        wait_until(lambda: "does not open under its message's key" in fleet.procs["pod-b"].output(),
                   "the forged part to fail under the announced key")
    finally:
        ctx.destroy(linger=0)
    assert "ignored data" not in fleet.procs["pod-b"].output()
    assert fleet.openai().completions.create(model="test", prompt="ok").choices[0].text == "OK!"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_oversized_and_many_part_messages_are_dropped_with_memory_flat(make_fleet):
    limit = 1 << 20
    flags = ("--max-frame-bytes", str(limit))
    fleet = two_stages(make_fleet, master_extra=flags, pod_extra=flags)
    data_addr = fleet.stages()["b"][0]["data_addr"]
    master_pid = fleet.procs["master"].pid
    many = [b"x" * 1000] * (C.MAX_FRAMES + 1000)  # about 5 MB a message, in small frames
    ctx = zmq.Context()
    try:
        ctl, push = fleet.control_peer(ctx), fleet.data_peer(ctx, data_addr)
        ctl.send_multipart([b"\x00" * (limit + 1)])  # over MAXMSGSIZE: the master closes this connection
        push.send_multipart([b"\x00" * (limit + 1)])
        ctl.close()
        ctl = fleet.control_peer(ctx)
        ctl.send_multipart(many)
        wait_until(lambda: fleet.metric("omnifleet_dropped_messages_total", socket="control") >= 1,
                   "the first many-part message to be dropped")
        # One at a time, so what is measured is what dropping keeps, not what the sender queued meanwhile.
        def drop_one(n: int) -> None:
            ctl.send_multipart(many)
            wait_until(lambda: fleet.metric("omnifleet_dropped_messages_total", socket="control") >= n,
                       f"many-part message {n} to be dropped")

        for n in range(2, 12):  # warm up: the allocator's high-water mark for one such message
            drop_one(n)
        base = rss_bytes(master_pid)
        rounds = 40  # 200 MB more
        for n in range(12, 12 + rounds):
            drop_one(n)
            push.send_multipart(many)
        growth = rss_bytes(master_pid) - base
        assert growth < 16 << 20, f"the master grew by {growth} bytes while dropping {rounds * 5} MB"
        wait_until(lambda: fleet.metric("omnifleet_stage_dropped_messages_total", stage="b") >= rounds,
                   "stage b to drop and report the many-part messages", timeout=60)
    finally:
        ctx.destroy(linger=0)
    assert fleet.metric("omnifleet_rejected_frames_total") == 0  # nothing of it reached a decoder
    assert "rejected frame on the data port" not in fleet.procs["pod-b"].output()
    assert fleet.openai().completions.create(model="test", prompt="flat").choices[0].text == "FLAT!"
    assert all(p.alive() for p in fleet.procs.values())
