"""Which node serves a request: session affinity, with new sessions placed on the least-loaded node.

A node's cache holds what its own sessions used, so a session that stays on one
node finds its history in that node's tiers: a request goes where its session
went before. A session seen for the first time goes to the least-loaded node,
where load is the blocks routed to the node over the last `window_s` seconds
(what its sessions are working through now), then the sessions ever placed
there, then the node's index: integers and an order, so two routers fed the
same requests agree (the simulator's and the live ingress).

A request that names no session is tied to the request it continues: a
conversation re-sends its earlier prompt, so if an earlier sessionless request's
last block sits in this one, the deepest such block's node serves it. Each such
tail is taken by the first request that continues it (the next turn then leaves
its own tail): a prompt that many conversations start from (a system prompt, or
one request that was only that prompt) would otherwise pull every conversation
after it to one node, where a second continuation is a branch that the load may
place anywhere.

Nodes may come and go (`join`, `leave`: a Serve deployment's replicas do): a
session whose node left is placed again, as a new one, on its next request. A
node that joins takes the lowest index a departed node left free (its sessions
and tails forgotten first, so none of them follows the index to the newcomer),
so a deployment that replaces its replicas all day keeps as many slots as it
ever ran at once.

Pure logic, no clock of its own: the caller passes each request's arrival time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Sequence

WINDOW_S = 300.0  # recent load: blocks routed over this many seconds
MAX_SESSIONS = 1 << 18  # sessions (and sessionless tails) remembered; beyond it the least recent half is forgotten


class SessionRouter:
    """Routes requests to `nodes` nodes; `route` is the whole decision."""

    def __init__(self, nodes: int, window_s: float = WINDOW_S, max_sessions: int = MAX_SESSIONS) -> None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s!r}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions!r}")
        self.nodes = nodes
        self.window_s = float(window_s)
        self._max_sessions = max_sessions
        self._home: OrderedDict[str, int] = OrderedDict()  # session -> node, least recently routed first
        self._tails: OrderedDict[Hashable, int] = OrderedDict()  # last block of a sessionless request -> node
        self._recent: list[deque[tuple[float, int]]] = [deque() for _ in range(nodes)]  # (arrival, blocks)
        self._recent_blocks = [0] * nodes
        self._placed = [0] * nodes  # sessions (and sessionless conversations) placed on each node
        self._gone: set[int] = set()  # nodes that left: never chosen again

    def route(self, session: str, blocks: Sequence[Hashable], now: float) -> int:
        """The node that serves a request of `session` ("" if it names none) with these block keys, arriving at
        `now` seconds; requests must come in arrival order."""
        self._expire(now)
        if session:
            node = self._home.get(session)
            if node is None or node in self._gone:
                node = self._home[session] = self._least_loaded()
            else:
                self._home.move_to_end(session)
            self._bound(self._home)
        else:
            node = self._continued(blocks)
            if blocks:
                self._tails[blocks[-1]] = node
                self._bound(self._tails)
        self._recent[node].append((now, len(blocks)))
        self._recent_blocks[node] += len(blocks)
        return node

    def join(self) -> int:
        """A node added: its index (the lowest a departed node left free, else the next one); new sessions may
        be placed there at once. Reusing an index scans the remembered sessions once: joins are rare."""
        if self._gone:
            node = min(self._gone)
            self._gone.discard(node)
            for remembered in (self._home, self._tails):
                for key in [k for k, n in remembered.items() if n == node]:
                    del remembered[key]
            self._placed[node] = 0
            return node
        self._recent.append(deque())
        self._recent_blocks.append(0)
        self._placed.append(0)
        self.nodes += 1
        return self.nodes - 1

    def leave(self, node: int) -> None:
        """Node `node` is gone: its sessions, and continuations of its sessionless requests, are placed again."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be one of 0..{self.nodes - 1}, got {node!r}")
        self._gone.add(node)
        self._recent[node].clear()
        self._recent_blocks[node] = 0

    @property
    def live(self) -> list[int]:
        return [n for n in range(self.nodes) if n not in self._gone]

    def load(self, node: int) -> tuple[int, int, int]:
        """What placement compares, least first: (blocks routed in the window, sessions placed, node)."""
        return self._recent_blocks[node], self._placed[node], node

    @property
    def sessions_known(self) -> int:
        return len(self._home)

    def _least_loaded(self) -> int:
        live = self.live
        if not live:
            raise RuntimeError("every node has left: there is nowhere to route")
        node = min(live, key=self.load)
        self._placed[node] += 1
        return node

    def _continued(self, blocks: Sequence[Hashable]) -> int:
        """The node of the sessionless request this one continues (its tail is taken), else a new placement."""
        tails = self._tails
        for block in reversed(blocks):
            node = tails.pop(block, None)
            if node is not None and node not in self._gone:
                return node
        return self._least_loaded()

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        for node, recent in enumerate(self._recent):
            while recent and recent[0][0] <= horizon:
                self._recent_blocks[node] -= recent.popleft()[1]

    def _bound(self, remembered: OrderedDict) -> None:
        if len(remembered) > self._max_sessions:
            for _ in range(len(remembered) // 2):
                remembered.popitem(last=False)
