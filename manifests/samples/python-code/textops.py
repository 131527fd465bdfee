"""User code of the python-code sample: two python stages, shipped in a ConfigMap (no image build).

Each function is a python stage: `fn(inputs, sampling_params, context)`, called per input item.
"""


def words(inputs, sampling_params, context):
    """The entry stage: the words of the user's last message, one chunk each (streamed downstream)."""
    messages = inputs if isinstance(inputs, list) else [{"content": str(inputs)}]
    text = messages[-1].get("content", "") if messages else ""
    limit = int(sampling_params.get("max_words", 64))
    yield from text.split()[:limit]


def shout(inputs, sampling_params, context):
    """The final stage: each word upper-cased, joined by spaces (a text delta per word)."""
    return ("" if context.chunk_index == 0 else " ") + str(inputs).upper()
