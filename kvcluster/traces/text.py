"""Conversations with text become requests: one per model turn, prompt = everything before it.

Chat format: Zephyr's template (zephyr-7b-beta, a Mistral-7B fine-tune on this vocabulary):
`<s>` then, per message, `<|{role}|>\\n` followed by `{content}</s>\\n`; roles are
system/user/assistant/tool. The header and the content of each message are
tokenized on their own and concatenated, so the prompt of turn t+1 starts with
exactly the tokens of turn t's prompt plus its answer, and their blocks share keys.
The prompt of an assistant turn ends with its `<|assistant|>\\n` header (typed
HISTORY: the template writes it, the model does not); its answer (content) is
the request's output. `<s>` takes the type of the first message.

Block keys come from the token ids (`KeySpace.chain_token_ids`, one namespace for
the whole trace, so equal system prompts share blocks across conversations);
block types from the message roles (majority of each block's tokens, see
classify.py); transitions from `PrefixClassifier`.

Text traces carry no times: conversation k starts at k x SESSION_GAP_S and its
turns follow TURN_GAP_S apart; requests are then ordered by that time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..block_types import BlockType
from ..keys import BlockKey, KeySpace
from ..tokenizer import load_fast_tokenizer
from .base import TraceRequest
from .classify import PrefixClassifier, majority_block_types

SESSION_GAP_S = 5.0
TURN_GAP_S = 30.0
BOS = "<s>"
END = "</s>\n"


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool (the chat-template role)
    content: str
    block_type: BlockType


@dataclass(frozen=True)
class Conversation:
    session: str
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class _Turn:
    arrival_s: float
    session: str
    prompt_tokens: int
    output_tokens: int
    keys: tuple[BlockKey, ...]
    types: tuple[BlockType, ...]


def conversations_to_requests(convs: Sequence[Conversation], block_size: int, *, agent: bool = False,
                              space: KeySpace | None = None) -> list[TraceRequest]:
    """Tokenize every message in one batch, cut each assistant turn into a request, label them."""
    space = space or KeySpace(model="trace:text")
    turns: list[_Turn] = []
    for k, (conv, encoded, headers, bos) in enumerate(_encode(convs)):
        turns += _turns(conv, encoded, headers, bos, k * SESSION_GAP_S, block_size, space)
    turns.sort(key=lambda t: t.arrival_s)
    classifier = PrefixClassifier(block_size, agent=agent)
    requests = []
    for t in turns:
        labels = classifier.label(t.keys, t.session, input_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                                  known=t.types)
        requests.append(TraceRequest(t.arrival_s, t.session, t.keys, t.types, labels.transition, t.prompt_tokens,
                                     t.output_tokens))
    return requests


def _conversation_tokens(conv: Conversation, encoded: list[list[int]], headers: dict[str, list[int]], bos: int
                         ) -> tuple[list[int], list[tuple[BlockType, int]], list[tuple[int, int]]]:
    """The whole conversation's token ids, typed spans, and (prompt length, answer length) per assistant turn."""
    tokens: list[int] = [bos]
    spans: list[tuple[BlockType, int]] = [(conv.messages[0].block_type if conv.messages else BlockType.HISTORY, 1)]
    asks: list[tuple[int, int]] = []
    for message, content in zip(conv.messages, encoded):
        header = headers[message.role]
        if message.role == "assistant" and len(tokens) > 1:  # a turn needs a message before it
            asks.append((len(tokens) + len(header), len(content)))
        tokens += header
        tokens += content
        if message.role == "assistant":  # the header is template, not generated: context
            spans += [(BlockType.HISTORY, len(header)), (message.block_type, len(content))]
        else:
            spans.append((message.block_type, len(header) + len(content)))
    return tokens, spans, asks


def _encode(convs: Sequence[Conversation]):
    tokenizer = load_fast_tokenizer()
    bos = tokenizer.token_to_id(BOS)
    headers = {role: tokenizer.encode(f"<|{role}|>\n", add_special_tokens=False).ids
               for role in {m.role for c in convs for m in c.messages}}
    contents = tokenizer.encode_batch([m.content + END for c in convs for m in c.messages], add_special_tokens=False)
    at = 0
    for conv in convs:
        yield conv, [e.ids for e in contents[at : at + len(conv.messages)]], headers, bos
        at += len(conv.messages)


def turn_prompts(convs: Sequence[Conversation]) -> list[list[tuple[list[int], int]]]:
    """Per conversation, (prompt token ids, answer length) of each assistant turn: a live replay's requests."""
    out = []
    for conv, encoded, headers, bos in _encode(convs):
        tokens, _, asks = _conversation_tokens(conv, encoded, headers, bos)
        out.append([(tokens[:prompt], answer) for prompt, answer in asks])
    return out


def _turns(conv: Conversation, encoded: list[list[int]], headers: dict[str, list[int]], bos: int, start_s: float,
           block_size: int, space: KeySpace) -> list[_Turn]:
    """The whole conversation is keyed and typed once; each turn takes its prefix."""
    tokens, spans, asks = _conversation_tokens(conv, encoded, headers, bos)
    keys = tuple(space.chain_token_ids(np.asarray(tokens, dtype="<i4"), block_size))
    types = tuple(majority_block_types(spans, block_size))
    out = []
    for turn, (prompt, answer) in enumerate(asks):
        full = prompt // block_size
        out.append(_Turn(start_s + turn * TURN_GAP_S, conv.session, prompt, answer, keys[:full], types[:full]))
    return out
