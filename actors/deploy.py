"""Start the cache actors on a running Ray cluster: index, predictor, and tier actors per node."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .index_actor import INDEX_NAME, NAMESPACE, IndexActor
from .predictor_actor import PREDICTOR_NAME, PredictorActor
from .tier_actor import TierActor, TierActorConfig, actor_name


def start_global_actors(checkpoint_dir: str, namespace: str = NAMESPACE, predictor_config: dict | None = None):
    """The index and the predictor: one each, detached, found again by name after a restart.

    `predictor_config` (a `PredictorConfig` dump) sets the priors of a predictor started here; one already
    running keeps its own."""
    index = IndexActor.options(name=INDEX_NAME, namespace=namespace, lifetime="detached", get_if_exists=True).remote()
    predictor = PredictorActor.options(name=PREDICTOR_NAME, namespace=namespace, lifetime="detached",
                                       get_if_exists=True).remote(checkpoint_dir, predictor_config)
    return index, predictor


def start_tier_actor(config: TierActorConfig, node_id: str, namespace: str = NAMESPACE, detached: bool = False):
    """A tier actor pinned to the Ray node `node_id` (hex), named kvcluster/<node>/<tier>.

    Detached actors (the CLI's) outlive the process that started them; an existing one is reused.
    """
    return TierActor.options(
        name=actor_name(config.node, config.tier),
        namespace=namespace,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        **({"lifetime": "detached", "get_if_exists": True} if detached else {}),
    ).remote(config.model_dump())
