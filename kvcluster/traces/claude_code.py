"""WEKA Claude Code traces (callanjfox/kv-cache-tester): one JSON file per session,
64-token blocks, hash ids local to the file.

A directory is merged into one timeline:
- Start times: session k (files in name order, k = 0, 1, ...) starts at
  k x SESSION_GAP_S; a request arrives at its session start + its `t`, a sub-agent
  request at the start + the sub-agent entry's `t` + its own `t`. All requests
  are then ordered by arrival (stable).
- Namespaces: hash ids are local, so every id is hashed as "local:{file stem}:{id}";
  sessions never collide, and sub-agents use their parent's namespace.
- The shared tools + system prefix. The files report it only as token counts
  (`tool_tokens`, `system_tokens`); each session's own leading hash ids already
  cover it (ids 1, 2, ... of its first request). It is modelled as shared by all
  sessions, as if they ran one agent build: its n = floor((tool_tokens +
  system_tokens) / 64) full blocks become blocks of one global namespace keyed by
  position ("shared:main:{j}"). These REPLACE the session's leading local ids
  rather than being prepended, so the input lengths stay what the trace says.
  Only ids that agree with the session's canonical prefix (the first n ids of its
  first request) are replaced: a request whose prefix diverges at position m < n
  (the prompt changed, or another model's prompt) shares only its first m blocks,
  so equal keys within a session still mean equal local ids. The block that
  straddles the end of the prefix (the ceil, not the floor) is not shared: it
  holds session tokens too. Sub-agents get the same treatment with their own
  counts, in a namespace per sub-agent type ("shared:{subagent_type}:{j}").
  Shared blocks are typed SYSTEM (a shared instruction prefix, DESIGN.md).
- Sessions for transitions: the file stem; a sub-agent is its own session
  "{stem}/{agent_id}" (its own chain of requests), still in the parent's namespace.
  `stop` (tool_use, end_turn) drives AGENT_STEP and TOOL typing (classify.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..block_types import BlockType
from ..errors import TraceError
from ..keys import KeySpace
from .base import Trace, TraceRequest
from .chains import HashKeyChain, common_prefix_len
from .classify import PrefixClassifier
from .records import Problems, check_block_size, count, head_text, int_list, read_json, require_path, seconds

BLOCK_SIZE = 64
SESSION_GAP_S = 60.0


@dataclass(frozen=True, slots=True)
class _Stream:
    """One chain of requests: a session's main agent, or one of its sub-agents."""

    session: str  # file stem, or stem/agent_id
    namespace: str  # file stem: whose local hash ids these are
    group: str  # shared-prefix namespace: "main" or the sub-agent type
    prefix_blocks: int  # full blocks of its tools + system prompt


@dataclass(frozen=True, slots=True)
class _Row:
    arrival_s: float
    stream: _Stream
    canonical: list[int]  # the local ids the shared prefix replaces
    ids: list[int]
    input_tokens: int
    output_tokens: int
    stop: str


class ClaudeCodeLoader:
    format = "claude-code"

    def sniff(self, path: str) -> bool:
        p = Path(path)
        first = min(p.glob("*.json"), default=None) if p.is_dir() else p if p.suffix == ".json" else None
        head = head_text(first) if first is not None else ""
        return head.lstrip().startswith("{") and '"requests"' in head and (
            '"hash_id_scope"' in head or '"block_size"' in head)

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None) -> Trace:
        """A directory (every *.json in it, one session each) or one session file;
        `max_records` caps the session files read."""
        p = require_path(path)
        bs = check_block_size(self.format, block_size, BLOCK_SIZE)
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        if not files:
            raise TraceError(f"no *.json session files in {p}")
        problems = Problems(strict)
        rows: list[_Row] = []
        for k, f in enumerate(files[:max_records]):
            doc = read_json(f, problems)
            if doc is None:
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
                problems.report(f"{f}:1", "not a session file (no 'requests' list)")
                continue
            if doc.get("block_size", bs) != bs:
                problems.report(f"{f}:1", f"block_size {doc.get('block_size')} is not {bs}")
                continue
            stream = _Stream(f.stem, f.stem, "main", _prefix_blocks(doc))
            _collect(f, doc["requests"], k * SESSION_GAP_S, stream, rows, problems, "record ")
        rows.sort(key=lambda r: r.arrival_s)
        return Trace(p.name if p.is_dir() else p.stem, self.format, bs, tuple(_requests(rows, bs)),
                     tuple(problems.lines))


def _prefix_blocks(doc: dict[str, Any]) -> int:
    """Full blocks of the reported tools + system prompt."""
    tokens = (count(doc.get("tool_tokens", 0)) or 0) + (count(doc.get("system_tokens", 0)) or 0)
    return tokens // BLOCK_SIZE


def _collect(f: Path, reqs: list, start: float, stream: _Stream, rows: list[_Row], problems: Problems,
             where: str) -> None:
    """Rows of one stream's requests; sub-agents recurse with their own stream."""
    canonical: list[int] | None = None
    for index, r in enumerate(reqs):
        here = f"{where}{index}"
        t = seconds(r.get("t")) if isinstance(r, dict) else None
        if t is None:
            problems.report(f"{f}:{here}", "request without a time 't' >= 0")
            continue
        if r.get("type") == "subagent":
            if not isinstance(r.get("requests"), list):
                problems.report(f"{f}:{here}", "sub-agent without a 'requests' list")
                continue
            agent = f"{stream.session}/{r.get('agent_id') or f'subagent{index}'}"
            sub = _Stream(agent, stream.namespace, str(r.get("subagent_type") or "subagent"), _prefix_blocks(r))
            _collect(f, r["requests"], start + t, sub, rows, problems, f"{here}/")
            continue
        ids, n_in, n_out = int_list(r.get("hash_ids")), count(r.get("in", 0)), count(r.get("out", 0))
        if ids is None or n_in is None or n_out is None:
            problems.report(f"{f}:{here}", "needs hash_ids: [int] and token counts in/out >= 0")
            continue
        if canonical is None:
            canonical = ids[: stream.prefix_blocks]
        rows.append(_Row(start + t, stream, canonical, ids, n_in, n_out, str(r.get("stop") or "")))


def _requests(rows: list[_Row], block_size: int) -> list[TraceRequest]:
    chain = HashKeyChain(KeySpace(model="trace:claude-code"))
    classifier = PrefixClassifier(block_size)
    out = []
    for row in rows:
        stream = row.stream
        m = common_prefix_len(row.ids, row.canonical)
        shared, local = f"shared:{stream.group}:", f"local:{stream.namespace}:"

        def label(position: int, hash_id: int, m: int = m, shared: str = shared, local: str = local) -> str:
            return f"{shared}{position}" if position < m else f"{local}{hash_id}"

        keys = chain.keys(row.ids, stream=stream.session, label=label)
        labels = classifier.label(keys, stream.session, input_tokens=row.input_tokens,
                                  output_tokens=row.output_tokens, stop=row.stop, known=(BlockType.SYSTEM,) * m)
        out.append(TraceRequest(row.arrival_s, stream.session, keys, labels.block_types, labels.transition,
                                row.input_tokens, row.output_tokens, stop=labels.stop_before, finish=row.stop))
    return out
