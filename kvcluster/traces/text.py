"""Conversations with text become requests: one per model turn, prompt = all before it.

Each message is tokenized on its own as "[role]\\n{content}\\n" and messages are
concatenated, so turn t+1's prompt starts with exactly turn t's tokens and its
blocks share keys. Text traces carry no times: session k starts at
k x `session_gap_s` and its turns follow `turn_gap_s` apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..block_types import BlockType, TransitionType
from ..keys import KeySpace
from ..tokenizer import load_fast_tokenizer
from .base import TraceRequest
from .classify import ROLE_TYPES, block_types_from_roles

SESSION_GAP_S = 5.0
TURN_GAP_S = 30.0
MODEL_ROLES = frozenset({"assistant", "gpt", "chatgpt", "bing"})


@dataclass(frozen=True)
class Conversation:
    session: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    agent: bool = False


def conversations_to_requests(convs: Sequence[Conversation], block_size: int, space: KeySpace) -> list[TraceRequest]:
    """Tokenize all messages in one batch and cut every model turn into a request."""
    tokenizer = load_fast_tokenizer()
    texts = [f"[{role}]\n{content}\n" for conv in convs for role, content in conv.messages]
    encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
    requests = []
    for k, conv in enumerate(convs):
        tokens: list[int] = []
        token_types: list[BlockType] = []
        turn = 0
        for role, _ in conv.messages:
            ids = next(encoded).ids
            if role in MODEL_ROLES and tokens:
                requests.append(_request(conv, k, turn, tokens, token_types, len(ids), block_size, space))
                turn += 1
            tokens.extend(ids)
            token_types.extend([ROLE_TYPES.get(role, BlockType.HISTORY)] * len(ids))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _request(conv, k, turn, tokens, token_types, out_len, block_size, space) -> TraceRequest:
    keys = tuple(space.chain_token_ids(tokens, block_size))
    if turn == 0:
        transition = TransitionType.FIRST
    else:
        transition = TransitionType.AGENT_STEP if conv.agent else TransitionType.APPEND
    return TraceRequest(
        arrival_s=k * SESSION_GAP_S + turn * TURN_GAP_S,
        session=conv.session,
        block_keys=keys,
        block_types=block_types_from_roles(token_types, block_size),
        transition=transition,
        input_tokens=len(tokens),
        output_tokens=out_len,
    )
