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
