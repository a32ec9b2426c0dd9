"""The Serve endpoint the serving tests share: Ray, Serve on a free port, two apps (started once per session)."""

from __future__ import annotations

import os
import socket
import tempfile

MODEL = "kvcluster-tiny-llama"
SECURE_MODEL = "kvcluster-tiny-sliding"
API_KEY = "sk-test-tenant-a"
OTHER_API_KEY = "sk-test-tenant-b"  # a second tenant of the authenticated app
METRICS: dict = {}
INFLIGHT_LIMIT = 8  # the default app sheds load past this many generation requests (tests saturate it)
DOC = "Ray Serve routes each request to a replica that already holds its prefix. " * 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_endpoint():
    """Ray, Serve on a free port, the default app and an authenticated one (sliding-window model)."""
    import ray
    from ray import serve

    from kvcluster.serve_apps.app import build_app

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="kvs", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = os.path.join(tmp, "cluster.yaml")
    with open(cluster, "w") as f:
        f.write(f"model: {MODEL}\nblock_tokens: 16\ncheckpoint_dir: {tmp}/pfs/predictor\nnodes:\n"
                f"  - name: n0\n    tiers:\n      - {{kind: dram, capacity: 0.05GiB}}\n"
                f"      - {{kind: pfs, capacity: 0.1GiB, path: {tmp}/pfs}}\n")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    METRICS["port"] = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             _temp_dir=tmp, log_to_driver=False, _metrics_export_port=METRICS["port"])
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "cluster": cluster, "replica_cpus": 0.5, "max_tokens_limit": 512,
                         "hbm_blocks": 48, "max_inflight_requests": INFLIGHT_LIMIT}),
              name="default", route_prefix="/")
    serve.run(build_app({"model": SECURE_MODEL, "cluster": None, "replica_cpus": 0.5,
                         "api_keys": [API_KEY, OTHER_API_KEY]}),
              name="secure", route_prefix="/secure")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def expected_cached(prompt_ids: list[int], stored: list[list[int]], block_tokens: int = 16) -> int:
    """The exact `cached_tokens` of a prompt once the token sequences `stored` are in the cache (nothing evicted).

    A request stores the whole blocks of its prompt plus every output token but the last (never fed back);
    a later prompt gets the whole blocks it shares with the longest of those, short of the block holding its
    own last token, which is always computed."""
    shared = 0
    for seq in stored:
        n = next((i for i, (a, b) in enumerate(zip(prompt_ids, seq)) if a != b), min(len(prompt_ids), len(seq)))
        shared = max(shared, n // block_tokens)
    return min(shared, (len(prompt_ids) - 1) // block_tokens) * block_tokens
