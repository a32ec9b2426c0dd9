"""Test settings shared by every test (quiet transformers, Ray without token auth) and the serving fixtures."""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


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
