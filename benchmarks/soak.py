"""Soak: the embedded default under bounded concurrent load, with faults injected, then saturated.

Starts Ray and the Serve app locally (dram small enough that the control
plane's policy demotes blocks to nvme and pfs), computes every prompt's greedy
answer in this process without any cache (the reference), then:

0. fault-free: the same clients for `--clean-seconds` with nothing injected;
   every corrupt read there is unexpected (`unexpected_corrupt`, must be 0: the
   demotions to nvme and pfs this load causes must never lose a block);
1. load: `--clients` asyncio clients send multi-turn prompts (shared prefixes)
   for `--seconds`; during it the dram tier actor, the predictor actor, the control plane and the
   model replica are killed, and the pfs block files are corrupted; each fault
   reports the corrupt reads counted after it, per tier, and only the pfs
   corruption may cause any (others add to `unexpected_corrupt`);
2. saturation: a burst of 4x the admission limit at once;
3. hostile (`--hostile`, or `--hostile-only` for it alone): the same clients
   without faults, first alone, then beside hostile ones sending oversized
   bodies, prompts far over the window, deeply nested JSON, invalid UTF-8,
   bodies trickled slowly and bodies that stall (issue 22). The normal load's
   p99 with and without them is reported; the hostile requests must all get 4xx.

Every answer is compared with the reference. Reported: requests held, p50/p99
latency, errors, 5xx, shed (503 + Retry-After), wrong outputs (must be 0), the
faults injected and whether the system answered correctly after each, the
corrupt reads (`ray_kvcluster_faults_total{kind="corrupt"}` scraped from the
node's metrics port) per phase and fault, and the replica's memory before and after.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soak.py [--json] [--seconds 60] [--clients 4] [--hostile]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from harness import JsonOutput  # noqa: E402
from ray import serve  # noqa: E402

from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.actors.node_control_actor import control_name  # noqa: E402
from kvcluster.actors.index_actor import NAMESPACE  # noqa: E402
from kvcluster.actors.predictor_actor import PREDICTOR_NAME  # noqa: E402
from kvcluster.cli import _non_negative_float, positive_int  # noqa: E402
from kvcluster.paths import shared_data_dir  # noqa: E402
from kvcluster.serving.models import load_model  # noqa: E402
from kvcluster.serving.runner import ModelRunner  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402
from kvcluster.traces.sharegpt import ShareGPTLoader  # noqa: E402
from kvcluster.serve_apps.app import build_app  # noqa: E402

MODEL = "kvcluster-tiny-llama"
MAX_TOKENS = 8
LIMIT = 8
BODY_TIMEOUT_S = 5.0  # the app's deadline for a request body (stalled senders get 408 after it)


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


METRICS_PORT: list[int] = []  # the node's metrics export port, set by `start`
METRICS_INTERVAL_S = [1.0]  # how often the node exports metrics (--metrics-interval-s), set by `main`
CORRUPTED_TIER = "n0/pfs"  # the one tier whose corrupt reads a fault of this soak causes


def start(tmp: str, shards: int = 1) -> str:
    os.environ["RAY_TMPDIR"] = tmp
    os.environ["RAY_metrics_report_interval_ms"] = str(round(METRICS_INTERVAL_S[0] * 1000))
    METRICS_PORT.append(free_port())
    start_ray(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
                               _temp_dir=tmp, log_to_driver=False, namespace=NAMESPACE,
                               _metrics_export_port=METRICS_PORT[-1]))
    cluster = Path(tmp) / "cluster.yaml"
    cluster.write_text(f"model: {MODEL}\nblock_tokens: 16\ncheckpoint_dir: {tmp}/pfs/predictor\n"
                       f"index_shards: {shards}\nnodes:\n"
                       f"  - name: n0\n    tiers:\n      - {{kind: dram, capacity: 1MiB}}\n"
                       f"      - {{kind: nvme, capacity: 1MiB, path: {tmp}/nvme}}\n"
                       f"      - {{kind: pfs, capacity: 512MiB, path: {tmp}/pfs}}\n")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "cluster": str(cluster), "replica_cpus": 0.5, "hbm_blocks": 64,
                         "max_inflight_requests": LIMIT, "request_body_timeout_s": BODY_TIMEOUT_S}),
              name="default", route_prefix="/")
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
    """Flip a byte in every pfs block file, then read them all through the pfs tier actor once, so that
    exactly this many corrupt reads are counted and attributable to this fault."""
    files = list(Path(tmp, "pfs", "kv").glob("??/??/*.kvb"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    pfs = ray.get_actor("kvcluster/n0/pfs", namespace=NAMESPACE)
    got = ray.get(pfs.get_many.remote([bytes.fromhex(f.stem) for f in files]), timeout=60)
    assert all(g is None for g in got), "a corrupted pfs block was served"
    return len(files)


def faults_counted() -> dict[str, float]:
    """Faults absorbed so far, as "component kind" -> count, from the node's Prometheus endpoint."""
    time.sleep(2.5 * METRICS_INTERVAL_S[0])  # metrics are exported every interval: let the last ones land
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT[-1]}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_kvcluster_faults_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            name = f"{labels.get('component')} {labels.get('kind')}"
            counts[name] = counts.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def corrupt_only(counts: dict[str, int | float]) -> dict[str, int]:
    """The corrupt reads among counted faults, per component."""
    return {name.split(" ")[0]: int(n) for name, n in counts.items() if name.endswith(" corrupt")}


def _since(now: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in now.items() if v - before.get(k, 0.0) > 0}


async def client_loops(client: httpx.AsyncClient, url: str, prompt_list: list[str], stop: float, clients: int,
                       results: list) -> None:
    """`clients` clients, each sending its share of the prompts in turn until `stop`; outcomes into `results`."""

    async def client_loop(k: int):
        i = k
        while time.monotonic() < stop:
            p = prompt_list[i % len(prompt_list)]
            code, text, latency, _ = await ask(client, url, p)
            results.append((p, code, text, latency))
            i += clients

    await asyncio.gather(*(client_loop(k) for k in range(clients)))


async def clean_phase(url: str, prompt_list: list[str], seconds: float, clients: int) -> list:
    """The load phase's clients with nothing injected."""
    results: list = []
    async with httpx.AsyncClient(timeout=300) as client:
        await client_loops(client, url, prompt_list, time.monotonic() + seconds, clients, results)
    return results


async def load_phase(url: str, prompt_list: list[str], expected: dict, seconds: float, clients: int, tmp: str):
    results, faults = [], []
    stop = time.monotonic() + seconds

    async def injector(client: httpx.AsyncClient):
        plan = [("kill dram tier actor", lambda: ray.kill(ray.get_actor("kvcluster/n0/dram", namespace=NAMESPACE),
                                                          no_restart=False)),
                ("kill predictor actor", lambda: ray.kill(ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE),
                                                          no_restart=False)),
                ("kill n0's controller", lambda: ray.kill(ray.get_actor(control_name("n0"), namespace=NAMESPACE),
                                                          no_restart=False)),
                ("corrupt every pfs block file", lambda: corrupt_pfs(tmp)),
                ("kill the model replica", lambda: ray.kill(replica_handle(), no_restart=True))]
        gap = seconds / (len(plan) + 1)
        for name, act in plan:
            await asyncio.sleep(gap)
            if faults:  # what was counted since the previous fault is that fault's
                faults[-1]["faults_counted_after"] = _since(await asyncio.to_thread(faults_counted), counted)
            counted = await asyncio.to_thread(faults_counted)
            detail = await asyncio.to_thread(act)
            t_fault = time.monotonic()
            code, text, _, _ = await ask(client, url, prompt_list[0])  # served correctly after the fault?
            faults.append({"fault": name, "detail": detail if isinstance(detail, int) else None,
                           "answered_correctly_after": code == 200 and text == expected[prompt_list[0]],
                           "recovery_s": time.monotonic() - t_fault})
        await asyncio.sleep(max(0.0, stop - time.monotonic()))
        faults[-1]["faults_counted_after"] = _since(await asyncio.to_thread(faults_counted), counted)
        for fault in faults:
            fault["corrupt_reads_after"] = corrupt_only(fault["faults_counted_after"])

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(client_loops(client, url, prompt_list, stop, clients, results), injector(client))
    return results, faults


async def saturation_phase(url: str, prompt_list: list[str], expected: dict):
    async with httpx.AsyncClient(timeout=300) as client:
        burst = [prompt_list[i % len(prompt_list)] for i in range(4 * LIMIT)]
        got = await asyncio.gather(*(ask(client, url, p) for p in burst))
    return [(p, code, text, latency, headers) for p, (code, text, latency, headers) in zip(burst, got)]


# ---- hostile phase (issue 22) ----------------------------------------------------------------------------


def _hostile_kinds(prompt: str) -> dict:
    """kind -> (body or async body factory, the statuses it may get)."""
    head = b'{"model": "%s", "prompt": ' % MODEL.encode()
    valid = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()

    async def trickle():  # a whole, valid body sent over ~2 s
        for i in range(0, len(valid), max(1, len(valid) // 10)):
            yield valid[i:i + max(1, len(valid) // 10)]
            await asyncio.sleep(0.2)

    return {"oversized_body": (head + b'"' + b"x" * (6 << 20) + b'"}', {413}),
            "prompt_over_window": (json.dumps({"model": MODEL, "prompt": "word " * 400_000}).encode(), {400}),
            "nested_json": (head + b"[" * 100_000 + b"]" * 100_000 + b"}", {400}),
            "invalid_utf8": (head + b'"caf\xc3\x28 \xff\xfe"}', {400}),
            "slow_sender": (trickle, {200}),
            "stalled_sender": (valid, {408})}


async def stalled_sender(url: str, body: bytes) -> tuple[int, float]:
    """Headers and half the body over a raw socket, then silence: (status the server ends it with, seconds)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
    await writer.drain()
    try:
        status = await asyncio.wait_for(reader.readline(), BODY_TIMEOUT_S + 30)
        return int(status.split()[1]) if status else -1, time.perf_counter() - t0
    except asyncio.TimeoutError:
        return -1, time.perf_counter() - t0
    finally:
        writer.close()


async def steady_load(client: httpx.AsyncClient, url: str, prompt_list: list[str], seconds: float, clients: int):
    """Normal traffic only: `clients` loops over the prompts for `seconds`."""
    results: list = []
    await client_loops(client, url, prompt_list, time.monotonic() + seconds, clients, results)
    return results


async def hostile_phase(url: str, prompt_list: list[str], expected: dict, seconds: float, clients: int) -> dict:
    """The normal load alone, then beside `clients // 2 + 1` hostile senders; 0 wrong and 0 5xx expected."""
    kinds = _hostile_kinds(prompt_list[0])
    outcomes: list[tuple[str, int, bool]] = []  # kind, status, as expected
    async with httpx.AsyncClient(timeout=300) as client:
        quiet = await steady_load(client, url, prompt_list, seconds, clients)
        stop = time.monotonic() + seconds

        async def hostile(k: int):
            names, i = list(kinds), k
            async with httpx.AsyncClient(timeout=120) as own:  # own connections: they may be closed on it
                while time.monotonic() < stop:
                    name = names[i % len(names)]
                    body, allowed = kinds[name]
                    try:
                        if name == "stalled_sender":
                            code, waited = await stalled_sender(url, body)
                            outcomes.append((name, code, code == 408 and waited < BODY_TIMEOUT_S + 5))
                            i += 1
                            continue
                        r = await own.post(f"{url}/v1/completions", content=body() if callable(body) else body,
                                           headers={"content-type": "application/json"})
                        code = r.status_code
                        right = code in allowed and (code != 200 or r.json()["choices"][0]["text"] ==
                                                     expected[prompt_list[0]])
                    except httpx.HTTPError as exc:
                        code, right = -1, False
                        print(f"hostile {name}: {type(exc).__name__}")
                    outcomes.append((name, code, right))
                    i += 1

        loud, _ = await asyncio.gather(steady_load(client, url, prompt_list, seconds, clients),
                                       asyncio.gather(*(hostile(k) for k in range(clients // 2 + 1))))
    by_kind: dict = {}
    for name, code, _ in outcomes:
        by_kind.setdefault(name, {}).setdefault(str(code), 0)
        by_kind[name][str(code)] += 1
    without, with_ = summarize(quiet, expected), summarize(loud, expected)
    return {"p99_s_without_hostile": without["p99_s"], "p99_s_with_hostile": with_["p99_s"],
            "normal_without_hostile": without, "normal_with_hostile": with_,
            "hostile_requests": len(outcomes), "hostile_as_expected": sum(r for _, _, r in outcomes),
            "hostile_5xx": sum(c >= 500 for _, c, _ in outcomes), "hostile_by_kind": by_kind}


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
    parser.add_argument("--seconds", type=_non_negative_float, default=60)
    parser.add_argument("--clients", type=positive_int, default=4)
    parser.add_argument("--conversations", type=positive_int, default=4)
    parser.add_argument("--clean-seconds", type=_non_negative_float, default=30,
                        help="length of the fault-free phase before the faults (0: none)")
    parser.add_argument("--shards", type=positive_int, default=1,
                        help="index shards")
    parser.add_argument("--hostile", action="store_true", help="also run the hostile phase (issue 22)")
    parser.add_argument("--hostile-only", action="store_true", help="run the hostile phase alone")
    parser.add_argument("--metrics-interval-s", type=float, default=1.0,
                        help="the node's metrics export interval; each fault count waits 2.5 of them")
    parser.add_argument("--settle-s", type=_non_negative_float, default=5.0,
                        help="pause between the faults and the saturation burst")
    args = parser.parse_args()
    if args.metrics_interval_s < 0.01:
        parser.error("--metrics-interval-s must be at least 0.01")
    METRICS_INTERVAL_S[0] = args.metrics_interval_s
    out = JsonOutput(args.json)  # Ray and Serve write to stdout from C++ too: only the report goes there
    prompt_list = prompts(args.conversations)
    reference = ModelRunner(load_model(MODEL))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = {p: reference.complete(reference.loaded.tokenizer.encode(p), greedy).text for p in prompt_list}
    tmp = tempfile.mkdtemp(prefix="kvsoak", dir="/tmp")
    url = start(tmp, args.shards)
    report: dict = {"prompts": len(prompt_list), "clients": args.clients, "seconds": args.seconds}
    try:
        if not args.hostile_only:
            report.update(fault_phases(url, prompt_list, expected, args, tmp))
        if args.hostile or args.hostile_only:
            report["hostile"] = asyncio.run(hostile_phase(url, prompt_list, expected, args.seconds, args.clients))
    finally:
        serve.shutdown()
        ray.shutdown()
    if out.enabled:
        out.emit(report, indent=1)
        return
    if "load" in report:
        print_fault_phases(report, args)
    if "hostile" in report:
        h = report["hostile"]
        print(f"hostile: normal load p99 {h['p99_s_without_hostile']:.2f} s alone, {h['p99_s_with_hostile']:.2f} s "
              f"beside {h['hostile_requests']} hostile requests ({h['hostile_as_expected']} answered as expected, "
              f"{h['hostile_5xx']} 5xx); normal load wrong outputs {h['normal_with_hostile']['wrong_outputs']}, "
              f"5xx {h['normal_with_hostile']['server_errors_5xx_other']}; by kind {h['hostile_by_kind']}")


def fault_phases(url: str, prompt_list: list[str], expected: dict, args, tmp: str) -> dict:
    """Phases 0, 1 and 2: load without faults, load with faults, then the saturation burst."""
    rss_before = replica_rss_mib()
    clean = asyncio.run(clean_phase(url, prompt_list, args.clean_seconds, args.clients)) if args.clean_seconds else []
    clean_corrupt = corrupt_only(faults_counted())
    results, faults = asyncio.run(load_phase(url, prompt_list, expected, args.seconds, args.clients, tmp))
    fault_corrupt = sum(n for f in faults for tier, n in f.get("corrupt_reads_after", {}).items()
                        if not (f["fault"] == "corrupt every pfs block file" and tier == CORRUPTED_TIER))
    time.sleep(args.settle_s)
    burst = asyncio.run(saturation_phase(url, prompt_list, expected))
    rss_after = replica_rss_mib()
    retry_after = all(h.get("retry-after") == "1" for _, code, _, _, h in burst if code == 503)
    return {"fault_free": {**summarize(clean, expected), "seconds": args.clean_seconds,
                           "corrupt_reads": {k: int(v) for k, v in clean_corrupt.items()}},
            "unexpected_corrupt": int(sum(clean_corrupt.values())) + fault_corrupt,
            "load": summarize(results, expected), "faults": faults,
            "saturation": {**summarize([r[:4] for r in burst], expected), "burst": len(burst),
                           "admission_limit": LIMIT, "retry_after_on_every_503": retry_after},
            "replica_rss_mib": {"before": rss_before, "after": rss_after}}


def print_fault_phases(report: dict, args) -> None:
    clean = report["fault_free"]
    if clean["requests"]:
        print(f"fault-free: {clean['requests']} requests in {clean['seconds']:.0f} s: {clean['ok']} ok, "
              f"{clean['wrong_outputs']} wrong, corrupt reads {clean['corrupt_reads'] or 0}")
    print(f"unexpected corrupt reads (fault-free phase, and faults that corrupt no bytes): "
          f"{report['unexpected_corrupt']}")
    load = report["load"]
    print(f"load: {load['requests']} requests from {args.clients} clients in {args.seconds:.0f} s: {load['ok']} ok, "
          f"{load['errors']} errors, {load['server_errors_5xx_other']} 5xx, {load['wrong_outputs']} wrong; "
          f"p50 {load['p50_s']:.2f} s, p99 {load['p99_s']:.2f} s")
    for f in report["faults"]:
        print(f"fault: {f['fault']}: answered correctly after: {f['answered_correctly_after']} "
              f"({f['recovery_s']:.1f} s); corrupt reads after it: {f.get('corrupt_reads_after') or 0}")
    s = report["saturation"]
    print(f"saturation: burst of {s['burst']} (limit {LIMIT}): {s['ok']} ok, {s['shed_503']} shed with 503 "
          f"(Retry-After on all: {s['retry_after_on_every_503']}), {s['server_errors_5xx_other']} other 5xx, "
          f"{s['wrong_outputs']} wrong")
    rss = report["replica_rss_mib"]
    print(f"replica RSS: {rss['before']:.0f} MiB before, {rss['after']:.0f} MiB after")


if __name__ == "__main__":
    main()
