"""One log line with the endpoint's URL once the Serve application answers (`serve run` prints it).

Serve marks an application RUNNING when every deployment's replicas are up, after
the ingress's constructor returned; so the ingress starts this watcher, which
asks the controller until then (or gives up after `timeout_s`) and prints the
URL clients use.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


def endpoint_url(details: dict, app_name: str) -> str | None:
    """http://host:port/prefix/v1 of `app_name` from Serve's instance details, once it is RUNNING."""
    application = details.get("applications", {}).get(app_name) or {}
    if application.get("status") != "RUNNING":
        return None
    http = details.get("http_options") or {}
    prefix = (application.get("route_prefix") or "/").rstrip("/")
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}{prefix}/v1"


def announce_when_ready(model: str, timeout_s: float = 1800.0, every_s: float = 1.0) -> threading.Thread:
    def watch() -> None:
        from ray import serve
        from ray.serve.context import _get_global_client

        try:
            app_name = serve.get_replica_context().app_name
            client = _get_global_client()
        except Exception as exc:  # not inside a Serve replica: nothing to announce
            log.debug("no readiness line: %s", exc)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                url = endpoint_url(client.get_serve_details(), app_name)
            except Exception:  # the controller is busy or restarting: ask again
                url = None
            if url:
                line = f"kvcluster: OpenAI endpoint ready at {url} (model {model!r})"
                print(line, flush=True)
                log.info(line)
                return
            time.sleep(every_s)

    thread = threading.Thread(target=watch, name="kvcluster-ready", daemon=True)
    thread.start()
    return thread
