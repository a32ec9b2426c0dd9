"""The 4 block types x 4 transition types the reuse predictor conditions on."""

from __future__ import annotations

from enum import IntEnum


class BlockType(IntEnum):
    """What a block's tokens are (see DESIGN.md)."""

    SYSTEM = 0  # a shared instruction prefix
    HISTORY = 1  # earlier turns and user context
    TOOL = 2  # tool results, retrieved documents
    OUTPUT = 3  # tokens the model generated


class TransitionType(IntEnum):
    """How a request relates to the requests before it."""

    FIRST = 0  # a new session
    APPEND = 1  # the next turn of the same conversation
    FORK = 2  # shares a prefix, then diverges
    AGENT_STEP = 3  # an agent loop continuing after a tool call


NUM_PAIRS = len(BlockType) * len(TransitionType)


def pair_index(block_type: int, transition: int) -> int:
    """Index 0..15 of a (block type, transition) pair."""
    return int(block_type) * len(TransitionType) + int(transition)
