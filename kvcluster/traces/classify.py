"""Block types and transition types for every trace format (one rule set, all loaders).

The reuse predictor keeps one posterior per (block type, transition) pair, so these
rules are part of the product. Requests are labelled in arrival order.

Full blocks. A request's first `input_tokens // block_size` keys are its full
blocks (all keys when the input length is unknown). A trailing partial block
(Mooncake lists one) is rewritten when the conversation grows, so a
continuation need only repeat the full blocks.

Transitions, decided in this order ("P" is the previous request of the session):
- AGENT_STEP: the session has a P, and P stopped with `tool_use` or the trace is
  an agent trace (SWE-agent): the agent loop goes on, even if it rewrote its
  prompt (e.g. a context compaction).
- APPEND: the request continues P: it repeats P's full blocks (and usually adds
  more). The last of them may differ, as appending text can re-tokenize the
  boundary (4% of the Claude Code steps repeat all but P's last block).
- FORK: it shares a leading run of keys with some earlier request but does not
  continue P: a regenerate, an edit, a branch, or a new session on a known
  system prompt (DESIGN.md counts the last one as a fork too).
- FIRST: nothing of it was seen before: a new session, or one that starts over.
Traces without session ids (Mooncake) infer them: if the leading run of seen
keys ends exactly at the last full (or last) key of an earlier request R, the
request continues R's session with R as P (APPEND, or AGENT_STEP for agent
traces); otherwise it opens a new session, as a FORK if the run is non-empty and
FIRST if it is empty. But for a key that SHARED_BRANCHES or more distinct
blocks have followed: that is a prompt many requests start from (a system
prompt, a popular document), and a run ending there says nothing of whose turn
follows. Without this, every new conversation on a system prompt whose first
message fits in the partial block after it ends its full blocks there, and all
later ones on that prompt continued the last of them: one session for the whole
trace. Continuations of one conversation, and the requests that share one long
prefix of their own, branch far less (on the shared Mooncake trace no run ended
at a key with more than 12 branches). Dicts from those end keys to their
requests, from seen keys to their first sighting and from keys to their branch
counts keep this O(total refs).

Block types. Explicit roles (ShareGPT, LMSYS, SWE-agent) come from the loader:
system -> SYSTEM, user/human -> HISTORY, tool results/observations -> TOOL,
assistant/gpt -> OUTPUT; see `ROLE_TYPES`. Hash-only traces (Mooncake, Bailian,
Claude Code) are inferred, block by block:
- a seen block that is shared by two or more sessions (this one included, i.e.
  it was seen before in another session) is SYSTEM;
- any other seen block keeps the type it got when it first appeared;
- new blocks of an APPEND/AGENT_STEP that continues P are cut by token position:
  up to P's input length they are P's prompt tail (the type of P's last block),
  the next `P.output_tokens` are P's answer (OUTPUT), the rest is new input:
  TOOL after a `tool_use` stop (a tool result), HISTORY otherwise;
- new blocks of FIRST/FORK requests (and of continuations that rewrote P) are
  HISTORY;
- a loader may fix the types of leading blocks it knows (Claude Code's shared
  tools+system prefix is SYSTEM).
A block spanning several of these slices (or several messages) takes the type
that owns most of its tokens; ties go to the earliest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..block_types import BlockType, TransitionType
from ..keys import BlockKey
from .chains import common_prefix_len

ROLE_TYPES: dict[str, BlockType] = {
    "system": BlockType.SYSTEM,
    "user": BlockType.HISTORY,
    "human": BlockType.HISTORY,
    "tool": BlockType.TOOL,
    "observation": BlockType.TOOL,
    "function": BlockType.TOOL,
    "ipython": BlockType.TOOL,
    "assistant": BlockType.OUTPUT,
    "gpt": BlockType.OUTPUT,
    "chatgpt": BlockType.OUTPUT,
    "bing": BlockType.OUTPUT,
    "model": BlockType.OUTPUT,
}
TOOL_USE = "tool_use"
_CONTINUATIONS = (TransitionType.APPEND, TransitionType.AGENT_STEP)
SHARED_BRANCHES = 16  # a key this many distinct blocks have followed is a shared prefix (see `_infer`)


def role_type(role: str) -> BlockType:
    """The block type of a message role; unknown roles count as user context (HISTORY)."""
    return ROLE_TYPES.get(role.lower(), BlockType.HISTORY)


def majority_block_types(spans: Sequence[tuple[BlockType, int]], block_size: int) -> list[BlockType]:
    """Type of each full block of a run-length typed token sequence: the type owning
    most of its tokens, ties to the earliest. A partial tail block gets none."""
    out: list[BlockType] = []
    counts: dict[BlockType, int] = {}  # insertion order = order of appearance
    filled = 0
    for kind, length in spans:
        while length > 0:
            if filled == 0 and length >= block_size:
                whole = length // block_size
                out.extend([kind] * whole)
                length -= whole * block_size
                continue
            take = min(length, block_size - filled)
            counts[kind] = counts.get(kind, 0) + take
            filled += take
            length -= take
            if filled == block_size:
                best = max(counts.values())
                out.append(next(t for t, c in counts.items() if c == best))
                counts.clear()
                filled = 0
    return out


class Labels(NamedTuple):
    session: str
    transition: TransitionType
    block_types: tuple[BlockType, ...]
    stop_before: str  # why the session's previous generation stopped ("" if unknown)


@dataclass(slots=True)
class _Request:
    """What later requests need to know about a labelled one."""

    session: str
    keys: tuple[BlockKey, ...]
    full: int  # leading keys that are full blocks
    input_tokens: int
    output_tokens: int
    stop: str
    types: tuple[BlockType, ...]
    shared_count: int  # size of the shared set when labelled: its types are current while unchanged


def _continues(reuse: int, prev: _Request) -> bool:
    """Whether a request whose first `reuse` keys are P's continues P: it repeats P's
    full blocks, or all but the last, which appending text may re-tokenize."""
    return reuse >= prev.full or 0 < reuse == prev.full - 1


class PrefixClassifier:
    """Labels the requests of one trace, fed in arrival order. O(total refs).

    `label(keys, session=None, ...)` with session=None infers the session from
    prefixes (Mooncake). `known` fixes the types of the leading blocks (all of
    them for traces with explicit roles).
    """

    def __init__(self, block_size: int, *, agent: bool = False) -> None:
        self._block_size = block_size
        self._agent = agent
        self._first: dict[BlockKey, tuple[str, BlockType]] = {}  # key -> (first session, first type)
        self._shared: set[BlockKey] = set()  # keys used by >= 2 sessions
        self._ends: dict[BlockKey, _Request] = {}  # inferred sessions: last full / last key -> request
        self._branches: dict[BlockKey, int] = {}  # key -> distinct keys seen right after it (its children)
        self._latest: dict[str, _Request] = {}  # session -> its latest request
        self._sessions = 0

    def label(self, keys: tuple[BlockKey, ...], session: str | None = None, *, input_tokens: int = 0,
              output_tokens: int = 0, stop: str = "", known: Sequence[BlockType] = ()) -> Labels:
        inferred = session is None
        if inferred:
            seen = self._seen_run(keys, 0)
            session, prev, transition = self._infer(keys, seen)
            reuse = common_prefix_len(keys, prev.keys) if prev else 0
        else:
            prev = self._latest.get(session)
            reuse = common_prefix_len(keys, prev.keys) if prev else 0
            seen = self._seen_run(keys, reuse)
            transition = self._transition(seen, reuse, prev)
        if len(known) >= len(keys):
            types = tuple(known[: len(keys)])
        else:
            types = self._types(keys, seen, reuse, session, prev, transition, known)
        self._remember(keys, reuse, session, types)
        full = min(len(keys), input_tokens // self._block_size) if input_tokens else len(keys)
        record = _Request(session, keys, full, input_tokens or len(keys) * self._block_size, output_tokens,
                          stop, types, len(self._shared))
        self._latest[session] = record
        if inferred and keys:
            self._ends[keys[-1]] = record
            if full:
                self._ends[keys[full - 1]] = record
        return Labels(session, transition, types, prev.stop if prev else "")

    def _seen_run(self, keys: tuple[BlockKey, ...], start: int) -> int:
        first, seen = self._first, start
        while seen < len(keys) and keys[seen] in first:
            seen += 1
        return seen

    def _infer(self, keys, seen: int) -> tuple[str, _Request | None, TransitionType]:
        owner = self._ends.get(keys[seen - 1]) if seen else None
        if owner is not None and self._branches.get(keys[seen - 1], 0) >= SHARED_BRANCHES:
            owner = None  # a prefix many requests branch from: a shared prompt, not one session's history
        if owner is not None:
            step = self._agent or owner.stop == TOOL_USE
            return owner.session, owner, TransitionType.AGENT_STEP if step else TransitionType.APPEND
        self._sessions += 1
        return f"s{self._sessions}", None, TransitionType.FORK if seen else TransitionType.FIRST

    def _transition(self, seen: int, reuse: int, prev: _Request | None) -> TransitionType:
        if prev is not None and (self._agent or prev.stop == TOOL_USE):
            return TransitionType.AGENT_STEP
        if prev is not None and _continues(reuse, prev):
            return TransitionType.APPEND
        return TransitionType.FORK if seen else TransitionType.FIRST

    def _types(self, keys, seen: int, reuse: int, session: str, prev: _Request | None,
               transition: TransitionType, known: Sequence[BlockType]) -> tuple[BlockType, ...]:
        shared, first = self._shared, self._first
        if prev is None or reuse == 0:
            out: list[BlockType] = []
        elif prev.shared_count == len(shared):
            out = list(prev.types[:reuse])
        else:
            out = [BlockType.SYSTEM if k in shared else t for k, t in zip(keys[:reuse], prev.types)]
        for k in keys[reuse:seen]:
            owner, kind = first[k]
            out.append(BlockType.SYSTEM if owner != session or k in shared else kind)
        new = len(keys) - seen
        if new and transition in _CONTINUATIONS and prev is not None and _continues(reuse, prev):
            out += self._continuation_types(seen, len(keys), prev)
        else:
            out += [BlockType.HISTORY] * new
        if known:
            out[: len(known)] = known
        return tuple(out)

    def _continuation_types(self, start_block: int, end_block: int, prev: _Request) -> list[BlockType]:
        """Types of blocks start_block..end_block-1: P's prompt tail, P's answer, then new input."""
        bs = self._block_size
        start, end = start_block * bs, end_block * bs
        answer_start = max(start, prev.input_tokens)
        answer_end = min(end, max(answer_start, prev.input_tokens + prev.output_tokens))
        tail = prev.types[min(prev.full, len(prev.types) - 1)] if prev.types else BlockType.HISTORY
        new_input = BlockType.TOOL if prev.stop == TOOL_USE else BlockType.HISTORY
        spans = [(tail, max(0, min(end, prev.input_tokens) - start)), (BlockType.OUTPUT, answer_end - answer_start),
                 (new_input, end - max(answer_end, start))]
        return majority_block_types([s for s in spans if s[1] > 0], bs)

    def _remember(self, keys, reuse: int, session: str, types: tuple[BlockType, ...]) -> None:
        """Record first sightings and cross-session sharing; the prefix shared with the
        session's previous request was recorded then."""
        first, shared, branches = self._first, self._shared, self._branches
        for j in range(reuse, len(keys)):
            k = keys[j]
            entry = first.get(k)
            if entry is None:
                first[k] = (session, types[j])
                if j:
                    before = keys[j - 1]
                    branches[before] = branches.get(before, 0) + 1
            elif entry[0] != session and k not in shared:
                shared.add(k)
