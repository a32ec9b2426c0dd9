"""The vLLM app's router: sessions stay on a replica, new ones spread by load, replicas come and go."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcluster.serve_apps.vllm_router import DIRECTORY_NAME, ReplicaSessions, rank_for

BLOCK = 4
SYSTEM = [7] * (2 * BLOCK)  # a system prompt every conversation starts with


def prompt(turn: int, session: int) -> list[int]:
    return SYSTEM + [100 + session] * BLOCK * turn


def test_sessions_sharing_a_system_prompt_spread_and_each_stays_on_its_replica() -> None:
    sessions = ReplicaSessions(BLOCK)
    replicas = ["r1", "r2", "r3"]
    first = [sessions.choose(replicas, f"q{s}", f"t/s{s}", prompt(1, s), now=float(s)) for s in range(6)]
    assert first == ["r1", "r2", "r3", "r1", "r2", "r3"]  # placed by load, not pulled together by SYSTEM
    later = [sessions.choose(replicas, f"q{s}-2", f"t/s{s}", prompt(2, s), now=10.0 + s) for s in range(6)]
    assert later == first


def test_a_retried_request_is_counted_once_and_keeps_its_replica() -> None:
    sessions = ReplicaSessions(BLOCK)
    assert sessions.choose(["a", "b"], "q1", "t/x", prompt(1, 0)) == "a"
    for _ in range(3):  # Serve asks again while the replica is full
        assert sessions.choose(["a", "b"], "q1", "t/x", prompt(1, 0)) == "a"
    assert sessions.router.load(0)[0] == 3  # the prompt's 3 blocks, once
    assert sessions.choose(["a", "b"], "q2", "t/y", prompt(1, 1)) == "b"


def test_sessionless_turns_follow_the_prompt_they_extend_per_tenant() -> None:
    sessions = ReplicaSessions(BLOCK)
    assert sessions.choose(["a", "b"], "q1", "", prompt(1, 0)) == "a"
    assert sessions.choose(["a", "b"], "q2", "", prompt(1, 1)) == "b"
    assert sessions.choose(["a", "b"], "q3", "", prompt(2, 1)) == "b"  # extends q2's prompt
    # another tenant's identical prompt is not a continuation of this one's (its keys are salted)
    assert sessions.choose(["a", "b"], "q4", "", prompt(3, 1), cache_salt="tenant-b") == "a"


def test_replicas_that_come_and_go() -> None:
    sessions = ReplicaSessions(BLOCK)
    assert sessions.choose(["a"], "q1", "t/x", prompt(1, 0)) == "a"
    assert sessions.choose(["a", "b"], "q2", "t/y", prompt(1, 1)) == "b"  # b joined: the least loaded
    assert sessions.choose(["b", "c"], "q3", "t/x", prompt(2, 0)) == "c"  # a left: x placed again, on c
    assert sessions.choose(["b", "c"], "q4", "t/x", prompt(3, 0)) == "c"
    assert sessions.choose(["b", "c"], "q5", "t/y", prompt(2, 1)) == "b"
    with pytest.raises(ValueError, match="no replica"):
        sessions.choose([], "q6", "t/x", prompt(1, 0))


def _replicas(*ids: str) -> list:
    return [SimpleNamespace(replica_id=rid) for rid in ids]


def test_the_chosen_replica_first_while_it_has_room() -> None:
    replicas = _replicas("a", "b", "c")
    assert rank_for(replicas, "b", {"a", "b", "c"}) == [[replicas[1]], [replicas[0], replicas[2]]]
    assert rank_for(replicas, "b", {"a", "c"}) == [replicas]  # full: Serve's shortest queue
    assert rank_for(replicas[:1], "a", {"a"}) == [[replicas[0]]]


def test_every_ingress_replica_sends_a_session_to_the_same_replica(endpoint) -> None:
    """Two front replicas (as a scaled-out ingress) call two engine-like replicas through the router: each
    session lands on one replica whichever front took its turn, and the sessions spread over both."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvcluster.serve_apps.vllm_router import SessionAffinityRouter

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0}, request_router_config=RequestRouterConfig(
        request_router_class=SessionAffinityRouter, request_router_kwargs={"block_tokens": BLOCK}))
    class Engine:
        async def generate(self, job: dict) -> str:
            return serve.get_replica_context().replica_id.unique_id

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, engine) -> None:
            self.engine = engine

        async def __call__(self, job: dict) -> tuple[str, str]:
            return serve.get_replica_context().replica_id.unique_id, await self.engine.generate.remote(job)

    front = serve.run(Front.bind(Engine.bind()), name="routing-check", route_prefix=None)
    try:
        # an odd number of sessions of unequal lengths: a session's turns reach both fronts, loads differ
        turns = [(s, t) for t in range(1, 5) for s in range(7)]
        served = [front.remote({"session": f"t/s{s}", "prompt_ids": prompt(t + s % 4, s)}).result(timeout_s=120)
                  for s, t in turns]
        fronts: dict[int, set] = {}
        homes: dict[int, set] = {}
        for (s, _), (front_id, engine) in zip(turns, served):
            fronts.setdefault(s, set()).add(front_id)
            homes.setdefault(s, set()).add(engine)
        assert sum(len(f) == 2 for f in fronts.values()) >= 3, f"too few sessions reached both fronts: {fronts}"
        assert all(len(h) == 1 for h in homes.values()), homes  # one replica per session, whichever front asked
        assert len(set().union(*homes.values())) == 2  # and the sessions spread over both
        directory = ray.get_actor(DIRECTORY_NAME, namespace="serve::routing-check::Engine")
        assert ray.get(directory.sessions_known.remote()) == 7
    finally:
        serve.delete("routing-check")


def test_an_ingress_decides_alone_while_the_directory_fails_and_asks_it_again_later() -> None:
    """A directory that cannot answer is asked once, then not again for ALONE_S: each request is routed at once
    by the ingress's own sessions, not after a timeout per request."""
    import asyncio

    import ray

    from kvcluster.serve_apps.vllm_router import SessionAffinityRouter

    class DeadDirectory:
        def __init__(self) -> None:
            self.calls = 0
            self.place = SimpleNamespace(remote=self.ask)

        def ask(self, *args):
            self.calls += 1
            answer = asyncio.get_running_loop().create_future()
            answer.set_exception(ray.exceptions.RayActorError())
            return answer

    router = SessionAffinityRouter.__new__(SessionAffinityRouter)  # its state alone: no Serve around it
    router.sessions, router.directory = ReplicaSessions(BLOCK), DeadDirectory()
    router.routed_alone, router.directory_answered, router.alone_until = 0, True, 0.0
    blocks = router.sessions.blocks(prompt(1, 0))

    async def route(n: int) -> list[str]:
        return [await router.place(["a", "b"], f"q{i}", "t/x", blocks) for i in range(n)]

    assert asyncio.run(route(3)) == ["a"] * 3  # the session kept its replica, decided alone
    assert router.directory.calls == 1 and router.routed_alone == 3
    router.alone_until = 0.0  # ALONE_S later
    asyncio.run(route(1))
    assert router.directory.calls == 2
