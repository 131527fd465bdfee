"""engines/mm.py: the media the master decoded -> a chat template's parts and vLLM's multi_modal_data."""

from __future__ import annotations

import struct

import pytest

from omnifleet_runtime.engines.base import BadInput
from omnifleet_runtime.engines.mm import split_media
from omnifleet_runtime.wire import Array

PIXELS = bytes(range(2 * 3 * 3))  # 2 x 3 RGB
SAMPLES = struct.pack("<4f", 0.0, 0.5, -0.5, 1.0)


def image(data=PIXELS, shape=(2, 3, 3), dtype="uint8"):
    return {"type": "image", "image": {"dtype": dtype, "shape": list(shape), "data": data}}


def audio(data=SAMPLES, shape=(4,), rate=16000):
    return {"type": "audio", "audio": {"dtype": "float32", "shape": list(shape), "data": data}, "sample_rate": rate}


def video(data=PIXELS, shape=(2, 1, 3, 3), fps=2.0, total=4, indices=(0, 3)):
    return {"type": "video", "video": {"dtype": "uint8", "shape": list(shape), "data": data}, "fps": fps,
            "total_frames": total, "max_frames": 32, "frame_indices": list(indices)}


def test_decoded_video_frames_go_with_the_metadata_vllm_s_loader_gives():
    _, mm = split_media([{"role": "user", "content": [video()]}], "s")
    frames, meta = mm["video"]
    assert frames.shape == (2, 1, 3, 3) and frames[1, 0, 0].tolist() == [9, 10, 11]
    assert meta == {"total_num_frames": 4, "fps": 2.0, "duration": 2.0, "video_backend": "opencv",
                    "frames_indices": [0, 3], "do_sample_frames": False}


def test_media_become_placeholders_and_multimodal_data():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [image(), audio(), {"type": "text", "text": "what?"}]}]
    rendered, mm = split_media(messages, "thinker")
    assert rendered == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                                     {"type": "text", "text": "what?"}]}]
    img = mm["image"]
    assert img.size == (3, 2) and img.mode == "RGB" and img.getpixel((1, 0)) == (3, 4, 5)
    samples, rate = mm["audio"]
    assert rate == 16000 and samples.tolist() == [0.0, 0.5, -0.5, 1.0]


def test_several_items_of_a_kind_are_a_list_and_wire_arrays_are_taken():
    part = {"type": "image", "image": Array("uint8", (2, 3, 3), memoryview(PIXELS))}
    _, mm = split_media([{"role": "user", "content": [part, image()]}], "s")
    assert isinstance(mm["image"], list) and len(mm["image"]) == 2 and "audio" not in mm


def test_text_only_messages_have_no_multimodal_data():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert split_media(messages, "s") == (messages, None)


@pytest.mark.parametrize("part, says", [
    (image(data=PIXELS[:6], shape=(2, 3)), "uint8 [height, width, 3]"),
    (image(data=PIXELS[:-1]), "is not uint8 of shape [2, 3, 3]"),
    (image(dtype="float32"), "expected uint8 data"),
    (audio(rate=0), "positive integer sample_rate"),
    (audio(rate=True), "positive integer sample_rate"),
    (audio(shape=(2, 2)), "mono float32 [samples]"),
    ({"type": "video", "video": {}}, "expected uint8 data"),
    (video(shape=(2, 3, 3)), "uint8 [frames, height, width, 3]"),
    (video(fps=-1), "needs fps >= 0, total_frames and one frame index per frame"),
    (video(indices=[0]), "one frame index per frame"),
    (video(indices=[0, 9]), "one frame index per frame"),
    ({"type": "video", "file": b"x", "max_frames": 0}, "positive integer max_frames"),
    ({"type": "clip"}, "got 'clip'"),
    ({"type": "image", "image": {"dtype": "uint8", "shape": [1, 1, 3], "data": None}}, "expected uint8 data"),
    ("text", "got 'None'"),
])
def test_a_part_it_cannot_take_is_refused_naming_it(part, says):
    with pytest.raises(BadInput) as e:
        split_media([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], "thinker")
    assert "stage 'thinker': messages[0].content[1]" in str(e.value) and says in str(e.value), str(e.value)


def test_content_of_another_type_is_refused():
    with pytest.raises(BadInput, match=r"messages\[0\].content must be a string or a list"):
        split_media([{"role": "user", "content": 5}], "s")
