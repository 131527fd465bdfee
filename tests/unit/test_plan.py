"""plan(): what a pass applies, leaves pending, and deletes."""

from omnifleet_operator.reconcile import AppliedCache, Children, plan


def cm(name, data, rv=None, owner="u1"):
    meta = {"name": name, "namespace": "ns", "ownerReferences": [{"uid": owner}]}
    if rv is not None:
        meta["resourceVersion"] = str(rv)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_missing_and_drifted_are_applied_and_removed_are_deleted():
    desired = [cm("a", {"k": "1"}), cm("b", {"k": "2"})]
    live = Children(objects=[cm("b", {"k": "changed"}, rv=5), cm("old", {}, rv=3), cm("foreign", {}, rv=4, owner="u2")])
    p = plan(desired, live, "u1")
    assert [o["metadata"]["name"] for o in p.apply] == ["a", "b"]
    assert [o["metadata"]["name"] for o in p.delete] == ["old"]


def test_own_write_not_yet_seen_is_pending_not_applied_again():
    cache = AppliedCache()
    want = cm("a", {"k": "2"})
    cache.record(want, 10)
    # The watch still shows the object from before our write (rv 7), or nothing yet.
    assert plan([want], Children(objects=[cm("a", {"k": "1"}, rv=7)]), "u1", cache).pending == [want]
    assert plan([want], Children(objects=[]), "u1", cache).pending == [want]
    # Once it shows our write or a later one, the normal comparison decides.
    p = plan([want], Children(objects=[cm("a", {"k": "2"}, rv=10)]), "u1", cache)
    assert p.apply == [] and p.pending == []
    p = plan([want], Children(objects=[cm("a", {"k": "hand-edited"}, rv=12)]), "u1", cache)
    assert p.apply == [want]
    # A different desired object is never pending; a deleted one is applied again.
    assert plan([cm("a", {"k": "3"})], Children(objects=[]), "u1", cache).apply
    cache.forget(("v1", "ConfigMap", "ns", "a"))
    assert plan([want], Children(objects=[]), "u1", cache).apply == [want]
