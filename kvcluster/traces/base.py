"""What every trace loader yields: requests as chains of block keys with types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

from ..block_types import BlockType, TransitionType
from ..keys import BlockKey


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, in arrival order.

    `block_keys` are prefix-chained (key i depends on keys 0..i-1), so a prefix hit
    is a run of leading keys. `block_types` has one entry per key.
    """

    arrival_s: float  # seconds since the trace started
    session: str  # conversation/session id; "" when the trace has none
    block_keys: tuple[BlockKey, ...]
    block_types: tuple[BlockType, ...]
    transition: TransitionType
    input_tokens: int
    output_tokens: int
    tenant: str = ""  # cache salt namespace
    stop: str = ""  # why the previous generation stopped, when known (e.g. "tool_use")
    finish: str = ""  # why this request's own generation stopped, when known: known once it is served


@dataclass(frozen=True)
class Trace:
    """A loaded trace: its requests plus what was skipped and why."""

    name: str
    format: str
    block_size: int  # tokens per block as the trace defines them
    requests: tuple[TraceRequest, ...]
    skipped: tuple[str, ...] = field(default=())  # "file:line: reason" for each malformed record

    @property
    def block_refs(self) -> int:
        return sum(len(r.block_keys) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        return len({k for r in self.requests for k in r.block_keys})


class TraceLoader(Protocol):
    """A loader reads one format. Malformed records are skipped and reported as
    "path:LINE: reason" (1-based line; "path:record N" inside a JSON document);
    with strict=True the first raises TraceError with that message.
    `max_records` (None = all) caps the records read, for quick looks at big files.
    A loader whose files carry no times sets `untimed = True` and takes a `clock`
    keyword (text.TraceClock) that draws them."""

    format: str

    def sniff(self, path: str) -> bool: ...

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None) -> Trace: ...


def iter_keys(trace: Trace) -> Iterator[BlockKey]:
    for request in trace.requests:
        yield from request.block_keys
