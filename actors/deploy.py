"""Start the cache actors on a running Ray cluster: index, predictor, and tier actors per node."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvcluster.errors import ConfigError

from .index_actor import NAMESPACE, IndexActor, shard_name
from .predictor_actor import PREDICTOR_NAME, PredictorActor
from .tier_actor import TierActor, TierActorConfig, actor_name


def start_global_actors(checkpoint_dir: str, namespace: str = NAMESPACE, predictor_config: dict | None = None,
                        index_shards: int = 1):
    """The index shards and the predictor, detached, found again by name after a restart; returns the handles
    of index shard 0 and of the predictor.

    `predictor_config` (a `PredictorConfig` dump) sets the priors of a predictor started here; one already
    running keeps its own. An index already running with another number of shards is an error: its keys
    would be looked up in the wrong shards."""
    index = [IndexActor.options(name=shard_name(i), namespace=namespace, lifetime="detached",
                                get_if_exists=True).remote(i, index_shards) for i in range(index_shards)]
    running = ray.get(index[0].shard_count.remote(), timeout=120)
    if running != index_shards:
        raise ConfigError(f"index_shards: the running index has {running} shards, the config asks for "
                          f"{index_shards}; run `kvcluster cluster down` first")
    predictor = PredictorActor.options(name=PREDICTOR_NAME, namespace=namespace, lifetime="detached",
                                       get_if_exists=True).remote(checkpoint_dir, predictor_config)
    return index[0], predictor  # shard 0, the one named kvcluster/index (IndexClient finds the rest)


def start_tier_actor(config: TierActorConfig, node_id: str, namespace: str = NAMESPACE, detached: bool = False):
    """A tier actor pinned to the Ray node `node_id` (hex), named kvcluster/<node>/<tier>.

    Detached actors (the CLI's) outlive the process that started them; an existing one is reused.
    """
    return TierActor.options(
        name=actor_name(config.node, config.kind),
        namespace=namespace,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        **({"lifetime": "detached", "get_if_exists": True} if detached else {}),
    ).remote(config.model_dump())
