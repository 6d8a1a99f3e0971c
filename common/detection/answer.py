"""The answer format: what the model is trained to say about a record, and the prompts that ask for it.

The model answers with one line::

    {"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_89|>", "<|coord_48|>", "<|coord_464|>", "<|coord_476|>"]}}

followed by the chat template's turn-end token (:data:`IM_END`). ``{}`` means no objects. ``data.answer_format:
objects_array`` writes ``{"objects": [{...}, ...]}`` instead (:data:`ANSWER_FORMATS`). Objects come in
:func:`canonical_order` for Channel-A and in matched-then-FN order for Channel-B.

What this module does not know: how a record is read or its boxes quantised (``common/data/records.py``),
tokenizers, or how a chat template renders the messages :func:`build_messages` returns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from common.data.records import GTObject, Record

# Qwen2/2.5-VL chat special tokens, in the order their ids follow each other in Qwen checkpoints.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the turn-end token: every assistant answer ends with it
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"  # one per merged vision patch after the processor expands it
VIDEO_PAD = "<|video_pad|>"
CHAT_SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    VIDEO_PAD,
)


def canonical_order(objects: Iterable[GTObject]) -> list[GTObject]:
    """Top-to-bottom, then left-to-right: sort by (y1, x1) bins; ties keep their given order."""
    return sorted(objects, key=lambda o: (o.bins[1], o.bins[0]))


#: ``data.answer_format``: the shape of the assistant JSON. ``object_keys`` (the origin at 622c7e4, the default):
#: ``{"object_1": {...}, "object_2": {...}}``, ``{}`` if empty; ``objects_array`` (the origin's later "CoordJSON
#: objects-array"): ``{"objects": [{...}, {...}]}``, ``{"objects": []}`` if empty. Each object is the same
#: ``{"desc": ..., "bbox_2d": [4 coord tokens]}`` in both, and the parser of one format reads the other as invalid.
ANSWER_FORMATS = ("object_keys", "objects_array")
OBJECTS_ARRAY_KEY = "objects"


def check_answer_format(answer_format: str) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}; set data.answer_format to one of "
                         f"{', '.join(ANSWER_FORMATS)}")
    return answer_format


def answer_opening(answer_format: str) -> str:
    """The text before the first object: what a rollout prefix with no complete object is cut back to."""
    return '{"' + OBJECTS_ARRAY_KEY + '": [' if check_answer_format(answer_format) == "objects_array" else "{"


def serialize_objects(objects: Sequence[GTObject], answer_format: str = "object_keys") -> str:
    """The single-line assistant JSON in ``answer_format`` (:data:`ANSWER_FORMATS`), objects in the order given;
    ``object_keys`` numbers the keys ``object_1..K``.

    Channel-A passes :func:`canonical_order` output; Channel-B passes matched-then-FN order.
    """
    if check_answer_format(answer_format) == "objects_array":
        payload: dict[str, Any] = {OBJECTS_ARRAY_KEY: [o.payload() for o in objects]}
    else:
        payload = {f"object_{i}": o.payload() for i, o in enumerate(objects, 1)}
    return json.dumps(payload, ensure_ascii=False, separators=(", ", ": "))


# NOTE: the coord tokens in these prompts are written as <|coord_N|> placeholders; "<|coord_N|>" is
# not one of the 1000 tokens, so the tokenizer spells it out like ordinary text.
SYSTEM_PROMPT = (
    "You are a visual object detector. Answer with exactly one JSON object on a single line: "
    '{"object_1": {"desc": "<short description>", "bbox_2d": ["<|coord_N|>", "<|coord_N|>", '
    '"<|coord_N|>", "<|coord_N|>"]}, "object_2": {...}}. '
    "Number the keys object_1, object_2, ... in reading order: top to bottom, then left to right. "
    'Each object has a short "desc" and exactly one geometry, "bbox_2d": its top-left corner x1, y1 '
    "and bottom-right corner x2, y2. Write every coordinate as one <|coord_N|> token, N from 0 to 999 "
    "being the position as a fraction of the image width or height times 999; never plain numbers. "
    "Use one space after each colon and comma and no line breaks. If there is no object, answer {}."
)
# The same instructions for data.answer_format: objects_array (the origin's later format).
SYSTEM_PROMPT_OBJECTS_ARRAY = (
    "You are a visual object detector. Answer with exactly one JSON object on a single line: "
    '{"objects": [{"desc": "<short description>", "bbox_2d": ["<|coord_N|>", "<|coord_N|>", '
    '"<|coord_N|>", "<|coord_N|>"]}, {...}]}. '
    "List the objects in reading order: top to bottom, then left to right. "
    'Each object has a short "desc" and exactly one geometry, "bbox_2d": its top-left corner x1, y1 '
    "and bottom-right corner x2, y2. Write every coordinate as one <|coord_N|> token, N from 0 to 999 "
    "being the position as a fraction of the image width or height times 999; never plain numbers. "
    'Use one space after each colon and comma and no line breaks. If there is no object, answer {"objects": []}.'
)
USER_PROMPT = (
    "Detect every object in the image. Answer with the single-line JSON object described in the "
    "instructions, objects ordered top to bottom then left to right, coordinates as <|coord_N|> tokens."
)


@dataclass(frozen=True)
class Prompts:
    """The system and user texts of every request (``data.system_prompt`` / ``data.user_prompt``) and the answer
    format they ask for (``data.answer_format``: every target is written and every answer parsed in it).

    A Stage-2 run must prompt its model exactly as its Stage-1 was trained; the defaults are the
    instructions above. The embedded tiny detector uses a one-line pair (configs/demo_cpu.yaml): with
    ~20 prompt tokens instead of ~200 its 16 image tokens are not drowned out and each CPU step costs
    a quarter (docs/warm_start.md).
    """

    system: str = SYSTEM_PROMPT
    user: str = USER_PROMPT
    answer_format: str = "object_keys"

    @classmethod
    def of(cls, system: str | None, user: str | None, answer_format: str = "object_keys") -> Prompts:
        """From the config's optional texts (None = the default instructions of ``answer_format``)."""
        default = SYSTEM_PROMPT_OBJECTS_ARRAY if check_answer_format(answer_format) == "objects_array" else SYSTEM_PROMPT
        return cls(system if system is not None else default, user if user is not None else USER_PROMPT, answer_format)


DEFAULT_PROMPTS = Prompts()


def build_messages(
    record: Record, image_paths: Sequence[str | os.PathLike[str]], assistant: str | None = None,
    prompts: Prompts = DEFAULT_PROMPTS,
) -> list[dict[str, Any]]:
    """Chat messages for one record: system prompt, then the user turn (images, then the prompt).

    Used by Channel-A, Channel-B, the rollout requests and evaluation, each with the run's
    ``prompts``, so all of them see the same prompt.
    Content is always a list of typed parts (``{"type": "image", "image": path}`` /
    ``{"type": "text", "text": ...}``), the form HF chat templates and processors expect.
    ``assistant`` (e.g. :func:`serialize_objects` output) appends the answer turn for teacher forcing.
    """
    if len(image_paths) != len(record.images):
        raise ValueError(f"record {record.id}: {len(record.images)} images but {len(image_paths)} paths given")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": prompts.system}]},
        {
            "role": "user",
            "content": [{"type": "image", "image": os.fspath(p)} for p in image_paths]
            + [{"type": "text", "text": prompts.user}],
        },
    ]
    if assistant is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
    return messages
