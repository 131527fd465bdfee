"""The operator's work queue: each key once, urgent keys (new or changed pipelines) first."""

from __future__ import annotations

import asyncio

from omnifleet_operator import handlers


def drain(q: handlers.WorkQueue) -> list:
    async def go():
        out = []
        while len(q):
            key = await asyncio.wait_for(q.get(), 1)
            q.done(key)
            out.append(key)
        return out
    return asyncio.run(go())


def test_urgent_keys_go_first_and_a_promoted_key_runs_once():
    q = handlers.WorkQueue()
    for key in ("a", "b", "c"):
        q.add(key)
    q.add("d", urgent=True)
    q.add("b", urgent=True)  # queued already: promoted, not queued twice
    q.add("d")  # queued urgent already: stays so
    assert len(q) == 4
    assert drain(q) == ["d", "b", "a", "c"]


def test_a_key_added_while_active_runs_again_after_with_its_urgency():
    q = handlers.WorkQueue()

    async def go():
        q.add("a")
        key = await q.get()
        q.add("a", urgent=True)  # changed while its pass runs
        q.add("b")
        assert len(q) == 1
        q.done(key)
        return [await q.get(), await q.get()]

    assert asyncio.run(go()) == ["a", "b"]


def test_urgent_waiting_counts_queued_urgent_keys_only():
    q = handlers.WorkQueue()

    async def go():
        q.add("a")
        assert not q.urgent_waiting()
        q.add("a", urgent=True)  # promoted
        q.add("b", urgent=True)
        q.add("b", urgent=True)  # queued urgent already: counted once
        seen = []
        for _ in range(2):
            key = await q.get()
            seen.append(q.urgent_waiting())
            q.add(key, urgent=True)  # changed while active: queued again when done, not now
            assert q.urgent_waiting() == seen[-1]
            q.done(key)
        return seen, q.urgent_waiting()

    assert asyncio.run(go()) == ([True, True], True)
