"""The wire decoder: every valid message round-trips; everything else is rejected, never a crash."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifleet_runtime import wire

payloads = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=3000),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def normalize(v):
    """What a payload looks like after the trip: tuples are lists, buffers are bytes."""
    return wire.walk(v, lambda x: bytes(x) if isinstance(x, (bytes, bytearray, memoryview)) else x)


@given(payloads, st.integers(0, 5), st.booleans())
def test_data_round_trips(payload, attempt, eof):
    msg = wire.Data("req-1", attempt, "talker", 3, payload, eof)
    back = wire.decode(wire.encode(msg))
    assert isinstance(back, wire.Data)
    assert (back.request_id, back.attempt, back.src, back.seq, back.eof) == ("req-1", attempt, "talker", 3, eof)
    assert normalize(back.payload) == normalize(payload)


def test_bulk_values_travel_as_frames_without_copies():
    big = bytearray(b"x" * 100_000)
    arr = wire.Array("float32", (10, 25), memoryview(bytes(1000)))
    frames = wire.encode(wire.Output("r", 0, "s", 0, {"audio": big, "t": arr, "small": b"ab"}))
    assert len(frames) == 3 and memoryview(frames[1]).obj is big  # a view of the caller's buffer
    back = wire.decode(frames)
    assert isinstance(back.payload["audio"], memoryview) and back.payload["audio"].obj is big
    assert back.payload["t"].shape == (10, 25) and back.payload["small"] == b"ab"


def test_every_message_type_round_trips():
    info = wire.RequestInfo("r", "chat", "m", messages=[{"role": "user", "content": "hi"}])
    msgs = [
        wire.Register("a", "pod", 1, "hash", "tcp://x:1", 7, "python"),
        wire.StageHeartbeat(1, 2, True, 3, 4, 5),
        wire.Output("r", 0, "a", 0, "text"),
        wire.Done("r", 0, "a", 2, "boom"),
        wire.ControlReply("c", True, {"x": [1, 2]}),
        wire.Deregister("bye"),
        wire.RegisterReply(False, "m1", 1, "no"),
        wire.MasterHeartbeat("m1"),
        wire.Reset("who"),
        wire.Dispatch("r", 1, "a", info, {"t": 0.5}, ["up"], [wire.Route("b", "pod", "tcp://y:2", True)], True),
        wire.Abort("r", 1),
        wire.Control("c", "sleep", {"level": 1}),
        wire.Data("r", 0, "a", 0, None, True),
    ]
    for msg in msgs:
        assert wire.decode(wire.encode(msg)) == msg


valid = wire.encode(wire.Data("r", 0, "a", 0, {"b": b"z" * 5000, "t": wire.Array("int16", (2,), b"abcd")}))
frame_lists = st.one_of(
    st.lists(st.binary(max_size=200), max_size=4),
    # mutations of a valid message: flipped bytes, dropped or extra frames
    st.tuples(st.integers(0, len(valid[0]) - 1), st.integers(0, 255)).map(
        lambda p: [valid[0][:p[0]] + bytes([p[1]]) + valid[0][p[0] + 1:], *valid[1:]]),
    st.integers(0, len(valid[0])).map(lambda n: [valid[0][:n], *valid[1:]]),
    st.lists(st.binary(max_size=50), max_size=3).map(lambda extra: [*valid, *extra]),
    st.just(valid[:2]),
    # well-formed msgpack of the wrong shape
    payloads.map(lambda v: [msgspec.msgpack.encode(v)]),
    st.dictionaries(st.sampled_from(["t", "request_id", "attempt", "src", "seq", "payload", "eof"]), payloads)
    .map(lambda d: [msgspec.msgpack.encode({"t": "Data", **d})]),
    st.tuples(st.integers(-3, 10), st.binary(max_size=20)).map(
        lambda e: [msgspec.msgpack.encode({"t": "Output", "request_id": "r", "attempt": 0, "stage": "s", "seq": 0,
                                           "payload": msgspec.msgpack.Ext(e[0] % 128, e[1])})]),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(frame_lists)
def test_decoder_never_crashes(frames):
    try:
        msg = wire.decode(frames)
    except wire.WireError as e:
        assert str(e)  # every rejection says why
        return
    assert isinstance(msg, wire.Msg)


def test_bad_frames_are_rejected_with_a_reason():
    cases = {
        "empty message": [],
        "truncated": [valid[0][:10], *valid[1:]],
        "not referenced": [*valid, b"extra"],
        "bad frame index": valid[:2],
        "unknown ext code": [msgspec.msgpack.encode({"t": "Data", "request_id": "r", "attempt": 0, "src": "a",
                                                     "seq": 0, "payload": msgspec.msgpack.Ext(9, b"\x90")})],
        "does not match": [valid[0], valid[1], b"abc"],  # int16[2] needs 4 bytes
        "Invalid value 'Pickle'": [msgspec.msgpack.encode({"t": "Pickle", "data": b"cos\nsystem\n"})],
    }
    for reason, frames in cases.items():
        try:
            wire.decode(frames)
        except wire.WireError as e:
            assert reason in str(e), (reason, str(e))
        else:
            raise AssertionError(f"accepted: {reason}")


def test_a_register_of_another_layout_still_shows_its_version():
    future = msgspec.msgpack.encode({"t": "Register", "protocol_version": 2, "stage": ["not", "a", "str"]})
    try:
        wire.decode([future])
        raise AssertionError("accepted")
    except wire.WireError:
        pass
    assert wire.peek_register_version(future) == 2
    assert wire.peek_register_version(b"\xc1") is None


def ipc(**over):
    fields = dict(device=0, handle=b"h" * 64, storage_size=4096, storage_offset=512, ref_counter_handle=b"/rc",
                  ref_counter_offset=3, event_handle=b"e" * 64, event_sync=True, dtype="float32",
                  shape=(4, 8), stride=(8, 1), offset=16)
    return wire.CudaIpc(**{**fields, **over})


def test_a_cuda_ipc_handle_round_trips_inline_with_no_frame():
    frames = wire.encode(wire.Data("r", 0, "producer", 0, {"x": ipc(), "t": 1.5}))
    assert len(frames) == 1  # only the handle travels
    back = wire.decode(frames).payload
    assert back == {"x": ipc(), "t": 1.5}


def test_cuda_ipc_handles_that_cannot_describe_a_tensor_in_its_storage_are_rejected():
    bad = {
        "unknown dtype": ipc(dtype="object"),
        "negative": ipc(offset=-1),
        "bool as int": ipc(device=True),
        "rank mismatch": ipc(stride=(1,)),
        "empty handle": ipc(handle=b""),
        "past the storage": ipc(shape=(4, 1000)),  # 16 + 3*8 + 999 elements of 4 B > 4096 B
    }
    for what, v in bad.items():
        try:
            wire.decode(wire.encode(wire.Data("r", 0, "p", 0, v)))
        except wire.WireError as e:
            assert "cuda ipc" in str(e), what
        else:
            raise AssertionError(f"{what}: accepted")
    # A header of the wrong shape (a field missing, a string where a number goes) is a rejection too.
    for header in ([0, b"h"], [0, b"h", "4096", 0, b"/rc", 0, None, False, "float32", [1], [1], 0]):
        frame = msgspec.msgpack.encode(wire.Data("r", 0, "p", 0, msgspec.msgpack.Ext(
            wire.EXT_CUDA_IPC, msgspec.msgpack.encode(header))))
        try:
            wire.decode([frame])
        except wire.WireError:
            pass
        else:
            raise AssertionError(f"header {header!r}: accepted")
    assert wire.decode(wire.encode(wire.Data("r", 0, "p", 0, ipc(shape=(0, 5), stride=(5, 1))))).payload.shape == (0, 5)
