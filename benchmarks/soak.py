"""Soak: the embedded default under bounded concurrent load, with faults injected, then saturated.

Starts Ray and the Serve app locally (dram small enough that the placement
controller spills to nvme and pfs), computes every prompt's greedy answer in
this process without any cache (the reference), then:

1. load: `--clients` asyncio clients send multi-turn prompts (shared prefixes)
   for `--seconds`; during it the dram tier actor, the predictor actor and the
   model replica are killed, and the pfs block files are corrupted;
2. saturation: a burst of 4x the admission limit at once.

Every answer is compared with the reference. Reported: requests held, p50/p99
latency, errors, 5xx, shed (503 + Retry-After), wrong outputs (must be 0), the
faults injected and whether the system answered correctly after each, and the
replica's memory before and after.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soak.py [--json] [--seconds 60] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from actors.index_actor import NAMESPACE  # noqa: E402
from actors.predictor_actor import PREDICTOR_NAME  # noqa: E402
from kvcluster.paths import shared_data_dir  # noqa: E402
from kvcluster.serving.models import load_model  # noqa: E402
from kvcluster.serving.runner import ModelRunner  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402
from kvcluster.traces.sharegpt import ShareGPTLoader  # noqa: E402
from serve_apps.app import build_app  # noqa: E402

MODEL = "kvcluster-tiny-llama"
MAX_TOKENS = 8
LIMIT = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n_conversations: int) -> list[str]:
    """Growing histories of real ShareGPT conversations: each turn's prompt starts with the previous one."""
    convs, _ = ShareGPTLoader().conversations(shared_data_dir() / "sharegpt_v3" / "sharegpt_v3_subset.jsonl",
                                              max_records=200)
    out = []
    for conv in convs:
        history = ""
        for m in conv.messages[:6]:
            history += f"{m.role}: {m.content[:300]}\n"
            if m.role == "user":
                out.append(history)
        if len({p.split(chr(10))[0] for p in out}) >= n_conversations:
            break
    return out


def start(tmp: str) -> str:
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, _temp_dir=tmp,
             log_to_driver=False, namespace=NAMESPACE)
    cluster = Path(tmp) / "cluster.yaml"
    cluster.write_text(f"model: {MODEL}\nblock_tokens: 16\ncheckpoint_dir: {tmp}/pfs/predictor\nnodes:\n"
                       f"  - name: n0\n    tiers:\n      - {{tier: dram, capacity_gib: 0.004}}\n"
                       f"      - {{tier: nvme, capacity_gib: 0.01, path: {tmp}/nvme}}\n"
                       f"      - {{tier: pfs, capacity_gib: 0.5, path: {tmp}/pfs}}\n"
                       "placement: {high_water: 0.5, low_water: 0.3, promote_above: 0.95}\n")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "cluster": str(cluster), "replica_cpus": 0.5, "hbm_blocks": 64,
                         "max_inflight_requests": LIMIT}), name="default", route_prefix="/")
    return f"http://127.0.0.1:{port}"


async def ask(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[int, str, float, dict]:
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                              "max_tokens": MAX_TOKENS, "temperature": 0})
    except httpx.HTTPError as exc:
        return -1, type(exc).__name__, time.perf_counter() - t0, {}
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    return r.status_code, text, time.perf_counter() - t0, dict(r.headers)


def replica_handle():
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "KVReplica" in a["name"]]
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def replica_rss_mib() -> float:
    pid = ray.get(replica_handle().__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def corrupt_pfs(tmp: str) -> int:
    files = list(Path(tmp, "pfs", "kv").glob("??/??/*.kvb"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    return len(files)


async def load_phase(url: str, prompt_list: list[str], expected: dict, seconds: float, clients: int, tmp: str):
    results, faults = [], []
    stop = time.monotonic() + seconds

    async def client_loop(k: int, client: httpx.AsyncClient):
        i = k
        while time.monotonic() < stop:
            p = prompt_list[i % len(prompt_list)]
            code, text, latency, _ = await ask(client, url, p)
            results.append((p, code, text, latency))
            i += clients

    async def injector(client: httpx.AsyncClient):
        plan = [("kill dram tier actor", lambda: ray.kill(ray.get_actor("kvcluster/n0/dram", namespace=NAMESPACE),
                                                          no_restart=False)),
                ("kill predictor actor", lambda: ray.kill(ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE),
                                                          no_restart=False)),
                ("corrupt every pfs block file", lambda: corrupt_pfs(tmp)),
                ("kill the model replica", lambda: ray.kill(replica_handle(), no_restart=True))]
        gap = seconds / (len(plan) + 1)
        for name, act in plan:
            await asyncio.sleep(gap)
            detail = await asyncio.to_thread(act)
            t_fault = time.monotonic()
            code, text, _, _ = await ask(client, url, prompt_list[0])  # served correctly after the fault?
            faults.append({"fault": name, "detail": detail if isinstance(detail, int) else None,
                           "answered_correctly_after": code == 200 and text == expected[prompt_list[0]],
                           "recovery_s": time.monotonic() - t_fault})

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(k, client) for k in range(clients)), injector(client))
    return results, faults


async def saturation_phase(url: str, prompt_list: list[str], expected: dict):
    async with httpx.AsyncClient(timeout=300) as client:
        burst = [prompt_list[i % len(prompt_list)] for i in range(4 * LIMIT)]
        got = await asyncio.gather(*(ask(client, url, p) for p in burst))
    return [(p, code, text, latency, headers) for p, (code, text, latency, headers) in zip(burst, got)]


def summarize(results, expected) -> dict:
    lat = [r[3] for r in results if r[1] == 200]
    wrong = sum(1 for p, code, text, _ in results if code == 200 and text != expected[p])
    return {"requests": len(results), "ok": sum(r[1] == 200 for r in results), "wrong_outputs": wrong,
            "shed_503": sum(r[1] == 503 for r in results), "server_errors_5xx_other": sum(
                r[1] >= 500 and r[1] != 503 for r in results), "errors": sum(r[1] not in (200, 503) for r in results),
            "p50_s": float(np.percentile(lat, 50)) if lat else None, "p99_s": float(np.percentile(lat, 99)) if lat else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=4)
    args = parser.parse_args()
    prompt_list = prompts(args.conversations)
    reference = ModelRunner(load_model(MODEL))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = {p: reference.complete(reference.loaded.tokenizer.encode(p), greedy).text for p in prompt_list}
    tmp = tempfile.mkdtemp(prefix="kvsoak", dir="/tmp")
    url = start(tmp)
    try:
        rss_before = replica_rss_mib()
        results, faults = asyncio.run(load_phase(url, prompt_list, expected, args.seconds, args.clients, tmp))
        time.sleep(5)
        burst = asyncio.run(saturation_phase(url, prompt_list, expected))
        rss_after = replica_rss_mib()
        retry_after = all(h.get("retry-after") == "1" for _, code, _, _, h in burst if code == 503)
        report = {"prompts": len(prompt_list), "clients": args.clients, "seconds": args.seconds,
                  "load": summarize(results, expected), "faults": faults,
                  "saturation": {**summarize([r[:4] for r in burst], expected), "burst": len(burst),
                                 "admission_limit": LIMIT, "retry_after_on_every_503": retry_after},
                  "replica_rss_mib": {"before": rss_before, "after": rss_after}}
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    load = report["load"]
    print(f"load: {load['requests']} requests from {args.clients} clients in {args.seconds:.0f} s: {load['ok']} ok, "
          f"{load['errors']} errors, {load['server_errors_5xx_other']} 5xx, {load['wrong_outputs']} wrong; "
          f"p50 {load['p50_s']:.2f} s, p99 {load['p99_s']:.2f} s")
    for f in faults:
        print(f"fault: {f['fault']}: answered correctly after: {f['answered_correctly_after']} "
              f"({f['recovery_s']:.1f} s)")
    s = report["saturation"]
    print(f"saturation: burst of {s['burst']} (limit {LIMIT}): {s['ok']} ok, {s['shed_503']} shed with 503 "
          f"(Retry-After on all: {s['retry_after_on_every_503']}), {s['server_errors_5xx_other']} other 5xx, "
          f"{s['wrong_outputs']} wrong")
    print(f"replica RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after")


if __name__ == "__main__":
    main()
