"""Test settings shared by every test (quiet transformers, Ray without token auth) and the serving fixtures."""

import os
import sys
import types

# Every process the suite starts (Ray workers, CLI runs, the vLLM suite) writes the bytecode of what it imports,
# whatever the caller's environment says: with PYTHONDONTWRITEBYTECODE set, each one compiled torch's, Ray's and
# transformers' modules from source again (`kvcluster size`: 13.1 s, against 7.2 s from bytecode).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A Ray call made after a test left Ray (a store thread still at work at `ray.shutdown`) raises here, where
# Ray would start a new local cluster from that thread: its processes die with the thread, and Ray ends the
# whole pytest process a minute later, with status 1 and no report.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """A model test's timings and outputs on one torch thread (the CI machine has two cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def endpoint():
    """The shared Serve endpoint (tests/serving_support.py), started on first use."""
    from serving_support import start_endpoint

    yield from start_endpoint()


@pytest.fixture(scope="session")
def client(endpoint):
    import openai

    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def reference():
    """The served model in this process, no cache: what every served greedy answer must equal."""
    from serving_support import MODEL

    from kvcluster.serving.models import load_model
    from kvcluster.serving.runner import ModelRunner

    return ModelRunner(load_model(MODEL))


# tests that wait for a background run (tests/background.py), in the order the runs go: they run last
BACKGROUND_WAITS = {"engine-suite": "tests/test_vllm_engine.py::",
                    "benchmark-smoke": "tests/test_every_benchmark_runs.py::"}


def waits_for(item) -> int:
    """0 for a test that waits for no background run, else 1 + the run's place in the chain."""
    for place, prefix in enumerate(BACKGROUND_WAITS.values()):
        if item.nodeid.startswith(prefix):
            return 1 + place
    return 0


def drives_ray(item) -> bool:
    """Whether the test's module drives Ray itself (imports it at module level: actors, clusters, live replays)."""
    return isinstance(getattr(getattr(item, "module", None), "ray", None), types.ModuleType)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Modules that drive Ray run after the others, the tests on the shared Serve endpoint after them, each group
    in its usual order, and the waits for the background runs last.

    Why this order: the engine suite runs in the background from the start (tests/background.py) and
    keeps both cores busy for its first minutes. A test made of many actor round trips waits for a core
    at every hop then (the live replays: 104 s alone, about 240 s beside it), while a test that computes
    in this process slows far less; so the Ray modules go after, when the engine suite is done or nearly
    (and the benchmarks' smoke run, one at a time, takes the core they leave idle).
    The endpoint's tests go last because modules that start a Ray session of their own (multi-node
    clusters, full restarts) end whatever session the process had, and with it the shared endpoint;
    started after them, it lives until the end."""
    items.sort(key=lambda item: (waits_for(item), "endpoint" in getattr(item, "fixturenames", ()),
                                 drives_ray(item)))


_CHAIN: list = []


def pytest_collection_finish(session) -> None:
    """Start the background runs this session waits for, one after another (tests/background.py).

    The engine suite only where vLLM is not importable here (else tests/vllm_engine is collected directly)
    and its venv exists; without the venv its waiting test fails with the reason."""
    import importlib.util

    import background

    if session.config.option.collectonly:
        return
    included = {name for name, prefix in BACKGROUND_WAITS.items()
                if any(item.nodeid.startswith(prefix) for item in session.items)}
    runs = []
    if ("engine-suite" in included and importlib.util.find_spec("vllm") is None
            and background.ENGINE_PYTHON.exists()):
        runs.append(background.engine_suite())
    if "benchmark-smoke" in included:
        runs.append(background.benchmark_smoke())
    if runs:
        _CHAIN.append(background.Chain(runs))


@pytest.fixture(scope="session")
def background_runs() -> dict:
    """The background runs started at collection, by name ({} when none was)."""
    return _CHAIN[0].runs if _CHAIN else {}


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    for chain in _CHAIN:  # a session that ended before its tests waited (-x, Ctrl-C) leaves nothing behind
        chain.stop()
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Once pytest has reported, tear NIXL agents down and leave without the interpreter's teardown.

    Why: about one full run in six exited with a segfault after every test had passed, during
    interpreter shutdown of this process (Ray driver, NIXL agents of in-process readers, torch),
    and a crash there must not turn a green run red. The agents are closed first, as any
    process's exit does (`kvcluster.storage.rdma`); `tests/test_copyhash.py` checks that a process
    ending with live agents exits cleanly on its own. KVCLUSTER_TEST_FULL_EXIT=1 keeps the full teardown.
    """
    if not _EXIT_STATUS or os.environ.get("KVCLUSTER_TEST_FULL_EXIT") == "1":
        return
    import sys

    from kvcluster.storage.rdma import _close_open_agents

    _close_open_agents()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
