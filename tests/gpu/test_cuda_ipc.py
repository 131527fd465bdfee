"""CUDA tensors between torch stages: by IPC handle within a pod (no copy, the producer's memory given
back once the consumer lets go), as host copies between pods."""

from __future__ import annotations

from fleet_harness import wait_until
from torch_handoff import ask, handoff_fleet, sent_bytes

N = 16 << 20  # float32 elements: 64 MiB
REQUESTS = 12


def test_colocated_cuda_tensors_cross_by_ipc_handle_and_their_memory_comes_back(make_fleet):
    fleet = handoff_fleet(make_fleet, "cuda", colocated=True)
    for i in range(REQUESTS):
        got = ask(fleet, N, i + 1)
        assert (got["n"], got["sum"], got["dtype"]) == (N, float(N * (i + 1)), "torch.float32"), got
        assert got["device"].startswith("cuda"), got
    wait_until(lambda: sent_bytes(fleet, "cuda_ipc") >= REQUESTS * 4 * N, "the producer to count its IPC bytes")
    assert sent_bytes(fleet, "cuda_ipc") == REQUESTS * 4 * N
    assert sent_bytes(fleet, "shm") == 0  # only the handle crossed, inline in the message
    assert sent_bytes(fleet, "tcp") < REQUESTS * 4096
    # Each tensor stays the producer's until the consumer frees its view; then it is reclaimed. Leaked,
    # the producer would hold all REQUESTS of them.
    status, body = fleet.control("fill", {"method": "ping"})
    assert status == 200, body
    held = body["replicas"]["colo"]["result"]["cuda_allocated_bytes"]
    assert held <= 3 * 4 * N, f"the producer holds {held} bytes of CUDA memory after {REQUESTS} handoffs"


def test_cuda_tensors_to_another_pod_go_as_host_copies(make_fleet):
    fleet = handoff_fleet(make_fleet, "cuda", colocated=False)
    for i in range(3):
        got = ask(fleet, N, i + 1)
        assert (got["n"], got["sum"]) == (N, float(N * (i + 1))) and got["device"].startswith("cuda"), got
    wait_until(lambda: sent_bytes(fleet, "tcp") >= 3 * 4 * N, "the producer to count its TCP bytes")
    assert sent_bytes(fleet, "cuda_ipc") == 0
