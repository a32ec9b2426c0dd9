"""The ingress asks the control plane to prefetch only for requests that will wait for a replica slot.

A request that runs at once would race the move (its blocks are in flight between tiers while it reads
them: a miss), so the rule is strict: more requests in flight than the replicas can run together."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from kvcluster.serve_apps.config import ServeAppConfig  # noqa: E402
from kvcluster.serve_apps.ingress import OpenAIIngress  # noqa: E402


class Recorder:
    """Stands in for the nodes' controllers: records `prefetch.remote` calls, per node."""

    def __init__(self, node: str = "", calls: list | None = None) -> None:
        self.node = node
        self.calls: list = [] if calls is None else calls
        self.prefetch = self

    def remote(self, *args) -> None:
        self.calls.append((self.node, *args))


def ingress(inflight: int, **cfg) -> tuple[object, Recorder]:
    cls = OpenAIIngress.func_or_class
    obj = cls.__new__(cls)
    obj.cfg = ServeAppConfig.model_validate({"max_ongoing_requests": 2, "autoscaling": {"max_replicas": 3}, **cfg})
    obj.inflight = inflight
    recorder = Recorder()
    obj._control = {"n0": Recorder("n0", recorder.calls)}
    return obj, recorder


def test_only_a_request_past_every_replica_slot_is_prefetched() -> None:
    keys = [b"k1", b"k2"]
    running, control = ingress(inflight=6)  # 3 replicas x 2 slots: this one still runs at once
    assert asyncio.run(running._prefetch_if_queued("n0", keys)) is False and control.calls == []
    queued, control = ingress(inflight=7)
    assert asyncio.run(queued._prefetch_if_queued("n0", keys)) is True and control.calls == [("n0", keys)]


def test_prefetch_can_be_turned_off_and_an_empty_prefix_sends_nothing() -> None:
    off, control = ingress(inflight=50, prefetch_queued=False)
    assert asyncio.run(off._prefetch_if_queued("n0", [b"k"])) is False
    empty, control2 = ingress(inflight=50)
    assert asyncio.run(empty._prefetch_if_queued("n0", [])) is False and control.calls == control2.calls == []
