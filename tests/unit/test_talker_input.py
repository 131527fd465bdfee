"""The stock Qwen2.5-Omni talker's input processor: the thinker's chunks as the talker's arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnifleet_runtime.engines.base import BadInput
from omnifleet_runtime.qwen2_5_omni import thinker_to_talker

HIDDEN = object()  # stands for the tap's array: the processor hands it on untouched


def chunks() -> list[dict]:
    return [{"prompt_token_ids": [1, 2], "token_ids": [5], "text": "a"},
            {"prompt_token_ids": None, "token_ids": [6, 7], "text": "b", "extra": {"hidden": HIDDEN}}]


def test_it_merges_the_thinkers_chunks_and_takes_the_voice():
    item = thinker_to_talker({"thinker": chunks()}, SimpleNamespace(extra={"audio": {"voice": "Ethan"}}))
    assert item == {"prompt_token_ids": [1, 2], "token_ids": [5, 6, 7], "hidden": HIDDEN, "speaker": "Ethan"}
    assert "speaker" not in thinker_to_talker({"thinker": chunks()}, SimpleNamespace(extra={}))


def test_a_thinker_without_the_tap_is_named_with_the_fix():
    with pytest.raises(BadInput, match="'thinker' sent no hidden states.*worker_extension_cls"):
        thinker_to_talker({"thinker": [{"prompt_token_ids": [1], "token_ids": [2]}]}, SimpleNamespace(extra={}))


def test_a_chunk_of_another_kind_is_a_bad_input_naming_the_stage():
    with pytest.raises(BadInput, match="'thinker'.*float"):
        thinker_to_talker({"thinker": [*chunks(), 1.5]}, SimpleNamespace(extra={}))
    with pytest.raises(BadInput, match="one upstream stage expected"):
        thinker_to_talker({"a": chunks(), "b": chunks()}, SimpleNamespace(extra={}))
