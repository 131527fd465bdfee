"""How a stage reads --master and finds the masters it names."""

from __future__ import annotations

import pytest

from omnifleet_runtime.discovery import BadMasterList, parse_masters, resolve


@pytest.mark.parametrize("value,expected", [
    ("10.0.0.1:5555", [("10.0.0.1", 5555)]),
    ("a:1, b:2,", [("a", 1), ("b", 2)]),
    ("[fd00::1]:5555,master-control.ns.svc:5555", [("fd00::1", 5555), ("master-control.ns.svc", 5555)]),
])
def test_parse_masters(value, expected):
    assert parse_masters(value) == expected


@pytest.mark.parametrize("value,message", [
    ("", "'' names no master"),
    (" , ", "names no master"),
    ("host", "'host' is not HOST:PORT"),
    (":5555", "':5555' is not HOST:PORT"),
    ("host:0", "'host:0' is not HOST:PORT"),
    ("host:http", "'host:http' is not HOST:PORT"),
])
def test_parse_masters_refuses_by_item(value, message):
    with pytest.raises(BadMasterList, match=message):
        parse_masters(value)


async def test_resolve_literals_and_names():
    found = await resolve([("127.0.0.1", 1), ("fd00::1", 2), ("localhost", 3)])
    assert found == {"tcp://127.0.0.1:1", "tcp://[fd00::1]:2", "tcp://127.0.0.1:3"}


async def test_a_name_that_does_not_resolve_keeps_what_the_stage_has():
    assert await resolve([("127.0.0.1", 1), ("no-such-master.invalid", 2)]) is None
