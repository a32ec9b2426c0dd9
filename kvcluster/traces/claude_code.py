"""WEKA Claude Code traces: one JSON file per session, 64-token blocks, local hash ids.

Merged into one timeline:
- session k (files in name order) starts at k x `session_gap_s` (60 s), each
  request at its session start + its `t`; sub-agent requests at the parent
  sub-agent entry's time + their own `t`, in the parent's namespace.
- hash ids are local: each session's keys are chained under its own namespace
  (the file id), so no two sessions collide.
- the tools + system prompt (`tool_tokens + system_tokens`, reported as counts
  only) is modelled as shared: its first floor(tokens / 64) blocks get keys from
  one global namespace, replacing the session's first local hash ids (which
  cover that same prefix). Sessions thus share the prefix up to the shorter of
  their two prompt lengths, as if their tool definitions agree that far.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..keys import KeySpace
from .base import Trace, TraceRequest
from .classify import HashTraceClassifier
from .records import Problems, int_list, number, require_file

SESSION_GAP_S = 60.0


class ClaudeCodeLoader:
    format = "claude-code"
    default_block_size = 64

    def sniff(self, path: str) -> bool:
        p = Path(path)
        files = sorted(p.glob("*.json"))[:1] if p.is_dir() else [p] if p.suffix == ".json" else []
        for f in files:
            try:
                head = f.read_text(errors="replace")[:4000]
            except OSError:
                return False
            return '"hash_id_scope"' in head or ('"requests"' in head and '"block_size"' in head)
        return False

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False, **_) -> Trace:
        p = require_file(path)
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        problems = Problems(strict)
        rows: list[tuple[float, str, list, int, int, str]] = []
        bs = block_size or self.default_block_size
        for k, f in enumerate(files):
            try:
                doc = json.loads(f.read_text(errors="replace"))
            except (OSError, json.JSONDecodeError) as exc:
                problems.report(f"{f}:1", f"not a JSON session file ({exc})")
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
                problems.report(f"{f}:1", "no 'requests' list")
                continue
            bs = int(doc.get("block_size") or bs)
            shared = int((number(doc.get("tool_tokens")) or 0) + (number(doc.get("system_tokens")) or 0)) // bs
            self._collect(f, doc["requests"], k * SESSION_GAP_S, str(doc.get("id", f.stem)), shared, rows, problems)
        rows.sort(key=lambda r: r[0])
        space = KeySpace(model=f"trace:{self.format}")
        classifier = HashTraceClassifier(bs)
        requests = []
        for ts, session, ids, in_len, out_len, stop in rows:
            keys = tuple(space.chain_hash_ids(ids))
            session, transition, types = classifier.classify(keys, session, out_len, stop)
            requests.append(TraceRequest(ts, session, keys, types, transition, in_len, out_len, stop=stop))
        name = p.name if p.is_dir() else p.stem
        return Trace(name, self.format, bs, tuple(requests), tuple(problems.lines))

    def _collect(self, f: Path, reqs: list, start: float, session: str, shared: int, rows: list, problems) -> None:
        for index, r in enumerate(reqs):
            where = f"{f}:request {index}"
            if not isinstance(r, dict) or number(r.get("t")) is None:
                problems.report(where, "request without a time 't'")
                continue
            if r.get("type") == "subagent":
                if isinstance(r.get("requests"), list):
                    self._collect(f, r["requests"], start + float(r["t"]), session, 0, rows, problems)
                continue
            ids = int_list(r.get("hash_ids"))
            if ids is None:
                problems.report(where, "hash_ids must be a list of ints")
                continue
            n = min(shared, len(ids))
            chain = [f"shared:{j}" for j in range(n)] + [f"{session}:{h}" for h in ids[n:]]
            rows.append((start + float(r["t"]), session, chain, int(number(r.get("in")) or 0),
                         int(number(r.get("out")) or 0), str(r.get("stop") or "")))
