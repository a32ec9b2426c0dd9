"""Tenants on the serving path: the blocks a request stores are found under its tenant's salt alone, so another
tenant's lookups (and an unsalted request's) find none of them; an API key is a tenant of its own.

The endpoint's replica answers from its own hbm before the cluster, so a leak in what the cluster holds would
not show in `cached_tokens` alone: the test asks the cluster's block index, as another node's replica would.
Runs on the shared Serve endpoint (tests/serving_support.py), whose app caches on a one-node cluster.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from kvcluster.keys import KeySpace  # noqa: E402

from serving_support import API_KEY, DOC, MODEL, OTHER_API_KEY, SECURE_MODEL, expected_cached  # noqa: E402

BLOCK = 16  # tokens per block: the cluster YAML's (serving_support.start_endpoint), and an app's without one
SALTS = ("tenant-a", "tenant-b", "")  # "": a request that names no salt


def test_on_the_cluster_a_tenants_blocks_are_found_under_its_own_salt_alone(client, reference) -> None:
    """Tenant A's request stores its blocks; the index lists them under A's keys only, so B's request and an
    unsalted one compute theirs (and store copies of their own, found under their keys), and A's next is served."""
    from ray import serve

    from kvcluster.actors.index_client import IndexClient

    prompt = "Whose blocks are these? " + DOC[:500]
    ids = reference.loaded.tokenizer.encode(prompt)
    usable = (len(ids) - 1) // BLOCK  # the prompt's blocks a later request of it can be served
    assert usable >= 4
    replica = serve.get_deployment_handle("KVReplica", app_name="default").info.remote().result(timeout_s=60)
    space = KeySpace(model=replica["fingerprint"])  # the replicas' keys: their fingerprint, the default root seed
    chains = {salt: [bytes(k) for k in space.chain_token_ids(ids[: usable * BLOCK], BLOCK, salt)] for salt in SALTS}

    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": "tenant-a"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    index = IndexClient.connect()

    def found() -> dict[str, int]:
        return {salt: index.longest_prefix(keys, timeout_s=30).length for salt, keys in chains.items()}

    deadline = time.monotonic() + 300
    while max((held := found()).values()) < usable:  # placed in the cluster's tiers after the answer
        assert time.monotonic() < deadline, f"the cluster never indexed tenant-a's blocks: {held}"
        time.sleep(0.2)
    assert held == {"tenant-a": usable, "tenant-b": 0, "": 0}  # under tenant-a's keys, nobody else's

    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": "tenant-b"})
    unsalted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == expected_cached(ids, [ids])
    deadline = time.monotonic() + 300
    while min((held := found()).values()) < usable:  # each stored a copy of its own, under its own keys
        assert time.monotonic() < deadline, f"the cluster never indexed the other tenants' copies: {held}"
        time.sleep(0.2)


@pytest.mark.parametrize("salt", [None, "one-salt-for-both"])
def test_two_api_keys_are_two_tenants_even_under_one_cache_salt(endpoint, salt) -> None:
    """The authenticated app salts each request with its key's tenant: a second key's request of the same prompt
    and `cache_salt` (or none) gets none of the first key's blocks, and the first key's next request gets them."""
    def tenant(key: str):
        return openai.OpenAI(base_url=f"{endpoint}/secure/v1", api_key=key, max_retries=0, timeout=120)

    a, b = tenant(API_KEY), tenant(OTHER_API_KEY)
    prompt = f"Keyed tenants ({salt}): " + DOC[:300]
    body = {"model": SECURE_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "extra_body": {"cache_salt": salt} if salt else None}
    first = a.completions.create(**body)
    other = b.completions.create(**body)
    again = a.completions.create(**body)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK  # its first request's
