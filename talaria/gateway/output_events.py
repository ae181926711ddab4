"""What the output parsers emit, and the one rule every incremental reader of tags shares.

The events are the contract between the parsers (talaria/gateway/output_parser.py, and the tag
formats' tool calls of talaria/gateway/xml_call_parser.py and talaria/gateway/glm_call_parser.py)
and the response formats (talaria/gateway/responses.py, talaria/gateway/anthropic_responses.py): a
streamed response sends them as they come, a whole response is their sum (`output_parser.assemble`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # 0, 1, ... in the order the calls appear
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments value's JSON text


Event = Content | Reasoning | CallStart | CallArguments


def held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until the
    next piece says whether they are the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
