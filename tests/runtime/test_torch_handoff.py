"""Torch stages hand tensors on: co-located on CPU through shared memory (the route offers CUDA IPC, and
with no CUDA tensor nothing goes that way). tests/gpu runs the same fleets on a GPU, where it does."""

from __future__ import annotations

from fleet_harness import wait_until
from fleet_harness import Scrape
from torch_handoff import ask, handoff_fleet, sent_bytes

N = 1 << 18  # float32 elements: 1 MiB


def test_colocated_torch_stages_on_cpu_hand_tensors_over_through_shared_memory(make_fleet):
    fleet = handoff_fleet(make_fleet, "cpu", colocated=True)
    for i in range(3):
        got = ask(fleet, N, 0.5 + i)
        assert (got["n"], got["sum"], got["device"], got["dtype"]) == (N, N * (0.5 + i), "cpu", "torch.float32")
    wait_until(lambda: sent_bytes(fleet, "shm") >= 3 * 4 * N, "the producer to count its shared-memory bytes")
    assert sent_bytes(fleet, "cuda_ipc") == 0


def test_torch_stages_in_two_pods_hand_large_tensors_over_sealed_parts(make_fleet):
    """16 MiB tensors between pods: sealed over the bulk port (the default curve data plane), put back
    together, read whole."""
    fleet = handoff_fleet(make_fleet, "cpu", colocated=False)
    n = 4 << 20  # float32 elements: 16 MiB
    for i in range(3):
        got = ask(fleet, n, 0.25 + i)
        assert (got["n"], got["sum"], got["device"]) == (n, n * (0.25 + i), "cpu")
    assert Scrape(fleet.metrics_ports["cons"]).value("omnifleet_worker_striped_messages_total", stage="check") >= 2
