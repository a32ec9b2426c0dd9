"""`serve run configs/serve.yaml` entry point: the ingress bound to the model replicas."""

from __future__ import annotations

from ray.serve import Application

from .config import ServeAppConfig
from .ingress import OpenAIIngress
from .replica import replica_deployment


def build_app(args: dict | None = None) -> Application:
    """Validate the args (errors name the field) and bind ingress -> replicas."""
    cfg = ServeAppConfig.model_validate(args or {})
    replicas = replica_deployment(cfg).bind(cfg.model_dump())
    return OpenAIIngress.bind(replicas, cfg.model_dump())
