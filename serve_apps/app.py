"""`serve run configs/serve_runner.yaml` entry point: the ingress bound to the model replicas."""

from __future__ import annotations

from ray.serve import Application

from kvcluster.actors.cluster import up
from kvcluster.cluster_config import load_cluster_config

from .config import ServeAppConfig
from .ingress import OpenAIIngress
from .replica import replica_deployment


def build_app(args: dict | None = None) -> Application:
    """Validate the args (errors name the field), start the cache cluster's actors, bind ingress -> replicas.

    Starting the cluster is this builder's one explicit step (`start_cluster`), done once per deploy
    and idempotent; replicas and the ingress only look its actors up."""
    cfg = ServeAppConfig.model_validate(args or {})
    if cfg.cluster is not None and cfg.start_cluster:
        up(load_cluster_config(cfg.cluster))
    replicas = replica_deployment(cfg).bind(cfg.model_dump())
    return OpenAIIngress.bind(replicas, cfg.model_dump())
