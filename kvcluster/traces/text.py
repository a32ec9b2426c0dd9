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

Text traces carry no times, so the loader draws them (`TraceClock`, docs/traces.md).
By default, seeded (seed 0): conversations, in file order, start as a Poisson
process (exponential gaps, mean SESSION_GAP_S; the first at 0 s), and each turn
follows its session's previous one after a think time drawn from the log-normal
fitted to the Claude Code traces (THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA). Same
seed, same times. `TraceClock(fixed=True)` is the old deterministic clock:
conversation k starts at k x SESSION_GAP_S and its turns follow TURN_GAP_S apart,
so a predictor would know each next turn's time exactly. Requests are then
ordered by time (stable).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..block_types import BlockType
from ..keys import BlockKey, KeySpace
from ..tokenizer import load_fast_tokenizer
from .base import TraceRequest
from .classify import PrefixClassifier, majority_block_types

SESSION_GAP_S = 5.0  # mean gap between conversation starts (exact gap with the fixed clock)
TURN_GAP_S = 30.0  # the fixed clock's gap between a conversation's turns
# Think time, the gap from one request of a session to its next: log-normal, ln(gap / 1 s) ~ N(MU, SIGMA^2).
# Fitted by maximum likelihood (mean and population standard deviation of ln gap) to the 7,450 gaps between
# consecutive top-level requests (`t`, sub-agents left out) of the 144 Claude Code sessions of the shared data
# (weka_claude_code_traces and weka_claude_code_traces_more; scripts/think_time_fit.py reproduces it). Median
# e^MU = 24.1 s (measured 17 s); quantiles 10/25/75/90/99%: fit 5.2/10.7/54/113/398 s, measured 8/11/37/129/1878 s.
# The measured gaps have the heavier tail (an agent's tool steps, then a person's long pauses); docs/traces.md.
THINK_TIME_LOG_MU = 3.1842
THINK_TIME_LOG_SIGMA = 1.2048
DEFAULT_CLOCK_SEED = 0
BOS = "<s>"
END = "</s>\n"


@dataclass(frozen=True)
class TraceClock:
    """How a trace without timestamps is timed: seeded random arrivals and think times (the default), or the
    fixed clock (`fixed=True`: SESSION_GAP_S between conversation starts, TURN_GAP_S between turns)."""

    fixed: bool = False
    seed: int = DEFAULT_CLOCK_SEED

    def describe(self) -> str:
        if self.fixed:
            return f"fixed: conversations {SESSION_GAP_S:g} s apart, turns {TURN_GAP_S:g} s apart"
        return (f"random (seed {self.seed}): Poisson conversation starts, mean {SESSION_GAP_S:g} s apart; "
                f"log-normal think times, median {math.exp(THINK_TIME_LOG_MU):.1f} s, sigma {THINK_TIME_LOG_SIGMA}")

    def times(self, turns_per_conversation: Sequence[int]) -> list[list[float]]:
        """Per conversation (in file order), the arrival time of each of its turns."""
        if self.fixed:
            return [[k * SESSION_GAP_S + j * TURN_GAP_S for j in range(n)]
                    for k, n in enumerate(turns_per_conversation)]
        rng = random.Random(self.seed)
        out, start = [], 0.0
        for k, n in enumerate(turns_per_conversation):
            if k:
                start += rng.expovariate(1.0 / SESSION_GAP_S)
            t, times = start, []
            for j in range(n):
                if j:
                    t += think_time(rng)
                times.append(t)
            out.append(times)
        return out


def think_time(rng: random.Random) -> float:
    """One draw of the fitted think time, in seconds."""
    return math.exp(rng.gauss(THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA))


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
                              space: KeySpace | None = None, clock: TraceClock | None = None) -> list[TraceRequest]:
    """Tokenize every message in one batch, cut each assistant turn into a request, time the turns by `clock`
    (default: seeded random, `TraceClock()`), label them in order of time."""
    space = space or KeySpace(model="trace:text")
    per_conv = [_turns(conv, encoded, headers, bos, block_size, space)
                for conv, encoded, headers, bos in _encode(convs)]
    turns: list[_Turn] = []
    for conv_turns, times in zip(per_conv, (clock or TraceClock()).times([len(c) for c in per_conv])):
        turns += [dataclasses.replace(t, arrival_s=at) for t, at in zip(conv_turns, times)]
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


def _turns(conv: Conversation, encoded: list[list[int]], headers: dict[str, list[int]], bos: int,
           block_size: int, space: KeySpace) -> list[_Turn]:
    """The whole conversation is keyed and typed once; each turn takes its prefix (untimed: arrival_s 0)."""
    tokens, spans, asks = _conversation_tokens(conv, encoded, headers, bos)
    keys = tuple(space.chain_token_ids(np.asarray(tokens, dtype="<i4"), block_size))
    types = tuple(majority_block_types(spans, block_size))
    out = []
    for prompt, answer in asks:
        full = prompt // block_size
        out.append(_Turn(0.0, conv.session, prompt, answer, keys[:full], types[:full]))
    return out
