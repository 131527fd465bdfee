from omnifleet_operator import quantity
from omnifleet_operator.drift import is_subset


def test_defaults_and_foreign_fields_are_ignored():
    desired = {"metadata": {"labels": {"a": "1"}}, "spec": {"replicas": 2}}
    live = {"metadata": {"labels": {"a": "1", "b": "2"}, "annotations": {"x": "y"}, "uid": "u"},
            "spec": {"replicas": 2, "paused": False}}
    assert is_subset(desired, live)


def test_changed_owned_field_is_drift():
    assert not is_subset({"spec": {"replicas": 2}}, {"spec": {"replicas": 3}})
    assert not is_subset({"spec": {"replicas": 2}}, {"spec": {}})
    assert not is_subset({"spec": {"replicas": 2}}, None)


def test_quantities_compare_by_value():
    assert is_subset({"memory": "1024Mi", "cpu": "1000m"}, {"memory": "1Gi", "cpu": "1"})
    assert not is_subset({"memory": "1Gi"}, {"memory": "1G"})


def test_a_hash_that_reads_as_a_huge_number_is_compared_as_a_string():
    # A hex hash of digits around one "e" matches a quantity's spelling, with an exponent past Decimal's range:
    # it made every reconcile of its pipeline raise (decimal.Overflow), so a rollout never went out.
    desired = {"metadata": {"annotations": {"omnifleet.dev/config-hash": "219e4567891234"}}}
    assert not is_subset(desired, {"metadata": {"annotations": {"omnifleet.dev/config-hash": "6cf1d55bfe35a9f3"}}})
    assert not is_subset(desired, {"metadata": {"annotations": {"omnifleet.dev/config-hash": "219e4567891235"}}})
    assert is_subset(desired, {"metadata": {"annotations": {"omnifleet.dev/config-hash": "219e4567891234"}}})
    assert quantity.parse("219e4567891234") is None and quantity.parse("2e3") == 2000


def test_keyed_lists_match_by_key_and_allow_extras():
    desired = {"containers": [{"name": "stage", "image": "i:1"}]}
    live = {"containers": [{"name": "sidecar", "image": "s"}, {"name": "stage", "image": "i:1", "tty": False}]}
    assert is_subset(desired, live)
    live["containers"][1]["image"] = "i:2"
    assert not is_subset(desired, live)


def test_scalar_lists_must_match_exactly():
    assert is_subset({"args": ["a", "b"]}, {"args": ["a", "b"]})
    assert not is_subset({"args": ["a", "b"]}, {"args": ["a", "b", "c"]})
    assert not is_subset({"args": ["a", "b"]}, {"args": ["b", "a"]})


def test_omitted_zero_values_match():
    assert is_subset({"spec": {"publishNotReadyAddresses": False, "ports": []}}, {"spec": {}})
    assert not is_subset({"spec": {"publishNotReadyAddresses": True}}, {"spec": {}})
