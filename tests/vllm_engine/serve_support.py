"""What the two Serve tests of the vLLM engine share: the long prompt, and Serve on a local Ray that leaves
nothing behind (its own short RAY_TMPDIR, restored after, so later tests in the process do not inherit it)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
from contextlib import contextmanager
from typing import Iterator

BLOCK = 128  # vLLM's block size on CPU
MODEL = "kvcluster-tiny-llama"
WORDS = ("cache", "block", "tier", "prefix", "replica", "token", "engine", "router", "memory", "layer")


def long_prompt(seed: int, words: int = 700) -> str:
    """A prompt of several 128-token blocks, the same for a seed."""
    return " ".join(random.Random(seed).choice(WORDS) for _ in range(words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_tmpdir(prefix: str) -> Iterator[str]:
    """A short temp dir as RAY_TMPDIR (short socket paths, nothing shared with other Ray instances), removed and
    the variable restored after, so later tests in the process do not inherit it."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir


@contextmanager
def local_serve(prefix: str) -> Iterator[tuple[str, int]]:
    """Ray (two CPUs) and Serve on a free port; yields (the temp dir, the port) and shuts both down after."""
    import ray
    from ray import serve

    with ray_tmpdir(prefix) as tmp:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, _temp_dir=tmp)
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield tmp, port
        finally:
            serve.shutdown()
            ray.shutdown()
