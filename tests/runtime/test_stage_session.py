"""A stage's session with one master (stage.StageWorker._session_loop), on a real ZMQ context: whatever
ends a session attempt, its control socket and that socket's monitor are closed, so the context's term()
returns and the pod can exit. A socket left open blocks term() until the pod is killed."""

from __future__ import annotations

import pytest
import zmq

from omnifleet_runtime.security import Keys
from omnifleet_runtime.stage import MasterSession, StageWorker
from omnifleet_runtime.validate import load_pipeline

from .fleet_harness import pipeline, stage
from .test_links import terminates


def keys() -> Keys:
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    return Keys(server[0], server[1], client[0], client[1], b"t" * 32)


async def test_a_session_whose_connect_raises_leaves_no_socket_open():
    doc = load_pipeline(pipeline(stage("a", "echo", finalOutput="text")))
    worker = StageWorker(doc, "a", "a-0", "127.0.0.1:1", "hash", keys=keys())
    worker.ctx = zmq.Context()
    # No port: libzmq's connect() refuses the address at once (EINVAL), after the socket and its
    # monitor were made.
    with pytest.raises(zmq.ZMQError):
        await worker._session_loop(MasterSession("tcp://127.0.0.1"))
    assert terminates(worker.ctx), "the session's socket or its monitor is still open: term() blocks"
