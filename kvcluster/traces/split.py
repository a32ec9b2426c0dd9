"""Tuning and validation parts of a trace: tune on one, report on the other.

A figure measured on the requests a default was chosen by says how well the
default fits them, not how it does on traffic it has not seen. Every shared
trace is therefore cut in two, by session, and the cut is fixed:

- **By session**: a session's requests reuse each other's blocks, so a session
  cut across both parts would let its tuning half tell the policy about its
  validation half. A Claude Code sub-agent (`stem/agent`) goes with its parent
  session (`stem`): it reads the parent's blocks.
- **By a strong hash of the session id**: the first 8 bytes of BLAKE2b
  (`SPLIT_SALT` as key) of the id, mod `PARTS`; 0 is the tuning part, the rest
  validation. A hash, not every k-th session, because file order is not random
  (ShareGPT's ids come in upstream order, SWE-agent's demos in folder order)
  and because a session's part then depends on its id alone: reading fewer or
  more records, another clock seed or another block size leaves every
  session's part as it was. Never Python's `hash`, which is salted per process.
- **Half and half** (`PARTS` = 2): both parts are traces of their own worth
  measuring; the smallest shared trace (SWE-agent, 22 trajectories) would keep
  too few sessions in a smaller part.

A part keeps the whole trace's requests of its sessions with their times and
labels as loaded, in order: it is the same timeline with the other part's
sessions left out, so a session's figures do not depend on the part it is read
in. Sessions a loader infers (Mooncake) are cut by their inferred id; an
inferred session that really continued a conversation of the other part is
then the one leak, documented in docs/traces.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable

from ..errors import TraceError
from .base import Trace

PARTS = 2  # sessions are spread over this many hash buckets; bucket 0 is the tuning part
SPLIT_SALT = b"kvcluster-split-v1"  # changing it re-cuts every trace: every quoted figure must be re-measured
PART_NAMES = ("tune", "validation", "all")


def split_key(session: str, format: str) -> str:
    """What a session is cut by: a Claude Code sub-agent's parent session (`stem/agent` -> `stem`), else the id.
    Other formats may have '/' in their ids (SWE-agent's relative paths), so only claude-code is cut there."""
    return session.split("/", 1)[0] if format == "claude-code" else session


def session_part(session: str, format: str = "") -> str:
    """"tune" or "validation": the part of the trace that the session belongs to, fixed by its id."""
    digest = hashlib.blake2b(split_key(session, format).encode("utf-8"), digest_size=8, key=SPLIT_SALT).digest()
    return "tune" if int.from_bytes(digest, "little") % PARTS == 0 else "validation"


def check_part(part: str, field: str = "part") -> str:
    """`part` if it names a part; TraceError naming `field` (the option that gave it) otherwise."""
    if part not in PART_NAMES:
        raise TraceError(f"{field}: unknown part {part!r}; choose one of {', '.join(PART_NAMES)}")
    return part


def part(trace: Trace, which: str, field: str = "part") -> Trace:
    """The requests of `trace` whose sessions belong to part `which` ("tune", "validation", or "all": the trace
    as it is), in order, times and labels unchanged; its name says which part it is."""
    if check_part(which, field) == "all":
        return trace
    if any(not r.session for r in trace.requests):
        raise TraceError(f"{trace.name}: requests without a session cannot be split into parts ({field})")
    kept = tuple(r for r in trace.requests if session_part(r.session, trace.format) == which)
    return dataclasses.replace(trace, name=f"{trace.name} ({which})", requests=kept)


def sessions_in(trace: Trace) -> set[str]:
    """The split keys of the sessions a trace holds (a Claude Code sub-agent counted with its parent)."""
    return {split_key(r.session, trace.format) for r in trace.requests}


def parts_of(sessions: Iterable[str], format: str = "") -> dict[str, set[str]]:
    """The sessions of each part: {"tune": {...}, "validation": {...}}."""
    out: dict[str, set[str]] = {"tune": set(), "validation": set()}
    for session in sessions:
        out[session_part(session, format)].add(split_key(session, format))
    return out
