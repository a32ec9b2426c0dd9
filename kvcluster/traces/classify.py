"""Block types and transition types for traces that do not label them.

Rules (the predictor conditions on these, so they are part of the product):

Transitions, per request:
- FIRST: a new session (the session id is new, or, for traces without session
  ids, no leading block was seen before).
- AGENT_STEP: the previous request of the session stopped with `tool_use`, or the
  trace is an agent trace (SWE-agent) past its first request.
- APPEND: the request's keys start with every key of the previous request of its
  session (for traces without session ids: its longest seen prefix ends exactly
  where an earlier request ended; it then joins that request's session).
- FORK: shares a prefix with earlier requests and diverges inside it.

Block types, per block:
- explicit roles: system -> SYSTEM, user/human -> HISTORY, tool/observation ->
  TOOL, assistant/gpt -> OUTPUT; a block spanning several messages takes the role
  that owns most of its tokens (ties: the earliest).
- hash-only traces: a block of the seen prefix that has appeared in two or more
  sessions is SYSTEM; other seen blocks are HISTORY; of the new blocks of an
  APPEND/AGENT_STEP request, the first ceil(previous output / block size) are the
  previous answer (OUTPUT), the rest are the new input: TOOL after a tool_use
  stop, HISTORY otherwise; new blocks of a FIRST/FORK request are HISTORY.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..block_types import BlockType, TransitionType
from ..keys import BlockKey


@dataclass
class _Session:
    last_keys_len: int
    last_key: BlockKey | None
    output_tokens: int
    stop: str


@dataclass
class HashTraceClassifier:
    """Streams requests of a hash-only trace in arrival order and labels them. O(refs)."""

    block_size: int
    agent: bool = False
    _first_session: dict[BlockKey, str] = field(default_factory=dict)  # key -> first session seen
    _shared: set[BlockKey] = field(default_factory=set)  # keys seen in >= 2 sessions
    _ends: dict[BlockKey, str] = field(default_factory=dict)  # last key of a request -> its session
    _sessions: dict[str, _Session] = field(default_factory=dict)
    _anon: int = 0

    def classify(
        self, keys: Sequence[BlockKey], session: str | None, output_tokens: int, stop: str = ""
    ) -> tuple[str, TransitionType, tuple[BlockType, ...]]:
        """Label one request; returns (session, transition, block types)."""
        seen = 0
        first = self._first_session
        while seen < len(keys) and keys[seen] in first:
            seen += 1
        session, transition = self._transition(keys, seen, session)
        types = self._types(keys, seen, session, transition)
        for key in keys:
            owner = first.setdefault(key, session)
            if owner != session:
                self._shared.add(key)
        if keys:
            self._ends[keys[-1]] = session
        self._sessions[session] = _Session(len(keys), keys[-1] if keys else None, output_tokens, stop)
        return session, transition, types

    def _transition(self, keys, seen: int, session: str | None) -> tuple[str, TransitionType]:
        if session is None:  # infer sessions from prefixes
            owner = self._ends.get(keys[seen - 1]) if seen else None
            if owner is not None:
                return owner, self._continuation(owner)
            self._anon += 1
            return f"s{self._anon}", TransitionType.FIRST if seen == 0 else TransitionType.FORK
        prev = self._sessions.get(session)
        if prev is None:
            return session, TransitionType.FIRST
        extends = prev.last_key is not None and prev.last_keys_len <= len(keys) and keys[prev.last_keys_len - 1] == prev.last_key
        if extends or prev.stop == "tool_use":
            return session, self._continuation(session) if extends else TransitionType.AGENT_STEP
        return session, TransitionType.FORK

    def _continuation(self, session: str) -> TransitionType:
        prev = self._sessions.get(session)
        if self.agent or (prev is not None and prev.stop == "tool_use"):
            return TransitionType.AGENT_STEP
        return TransitionType.APPEND

    def _types(self, keys, seen: int, session: str, transition: TransitionType) -> tuple[BlockType, ...]:
        shared = self._shared
        first = self._first_session
        out = [
            BlockType.SYSTEM if (k in shared or first.get(k, session) != session) else BlockType.HISTORY
            for k in keys[:seen]
        ]
        new = len(keys) - seen
        if transition in (TransitionType.APPEND, TransitionType.AGENT_STEP):
            prev = self._sessions.get(session)
            answer = -(-prev.output_tokens // self.block_size) if prev else 0
            answer = min(answer, new)
            rest = BlockType.TOOL if prev is not None and prev.stop == "tool_use" else BlockType.HISTORY
            out += [BlockType.OUTPUT] * answer + [rest] * (new - answer)
        else:
            out += [BlockType.HISTORY] * new
        return tuple(out)


ROLE_TYPES = {
    "system": BlockType.SYSTEM,
    "user": BlockType.HISTORY,
    "human": BlockType.HISTORY,
    "tool": BlockType.TOOL,
    "observation": BlockType.TOOL,
    "function": BlockType.TOOL,
    "assistant": BlockType.OUTPUT,
    "gpt": BlockType.OUTPUT,
    "chatgpt": BlockType.OUTPUT,
    "bing": BlockType.OUTPUT,
}


def block_types_from_roles(token_types: Sequence[BlockType], block_size: int) -> tuple[BlockType, ...]:
    """Type of each full block: the type owning most of its tokens (ties: the earliest)."""
    out = []
    for start in range(0, len(token_types) - block_size + 1, block_size):
        window = token_types[start : start + block_size]
        counts: dict[BlockType, int] = {}
        for t in window:
            counts[t] = counts.get(t, 0) + 1
        best = max(counts.values())
        out.append(next(t for t in window if counts[t] == best))
    return tuple(out)
