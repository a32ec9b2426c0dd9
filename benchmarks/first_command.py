"""What the README's first command shows, measured: vLLM with kvcluster against vLLM alone, on configs/serve.yaml.

Each arm runs the very app of the README's first command (`serve run configs/serve.yaml` from .venv-vllm, as a
subprocess with a Ray of its own), with its tier directories moved under a fresh temporary directory (so every
run starts cold) and a free port; the `vllm_alone` arm is the same app with `connector: null` (vLLM's own prefix
cache only). Through the HTTP API, as a client sees it:

1. prompt A (`--prompt-tokens` long) cold;
2. `--others` other prompts of the same length: more than the app's own vLLM paged KV holds, so vLLM evicts A;
3. A again: with kvcluster its prefix comes back from kvcluster's tiers (`cached_tokens`), the same greedy text;
4. (kvcluster arm) the app is stopped (SIGINT, as Ctrl-C) and started again; A again: its prefix comes back from
   the pfs directory the stopped app left (the connector's shutdown copies its memory tiers there);
5. A once more: now in vLLM's own prefix cache (the hot reference).

TTFT is the time from sending the streamed request to its first text chunk, on this machine's CPU, one request at
a time, after one short warm-up request per start of the app; each figure is one request (the first command's experience, not a distribution). The model is the
embedded default (kvcluster-tiny-llama: random weights, so the text is gibberish; greedy decoding makes it
repeatable).

    .venv-vllm/bin/python benchmarks/first_command.py [--json] [--prompt-tokens 3000] [--others 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "serve.yaml"
WORDS = ("cache", "block", "tier", "prefix", "replica", "token", "engine", "router", "memory", "layer", "page",
         "node", "shard", "queue", "latency", "batch", "stream", "policy", "reuse", "evict")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(workdir: Path, port: int, kvcluster: bool, kv_blocks: int | None, max_model_len: int | None) -> Path:
    """configs/serve.yaml with its port, its tier paths under `workdir`, and (vLLM alone) no connector."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["http_options"]["port"] = port
    (app,) = cfg["applications"]
    args = app["args"]
    if not kvcluster:
        args["connector"] = None
    else:
        for tier in args["connector"]["tiers"]:
            if tier.get("path"):
                tier["path"] = str(workdir / tier["kind"])
    if kv_blocks is not None:
        args["kv_cache_blocks"] = kv_blocks
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    path = workdir / ("serve.yaml" if kvcluster else "serve_vllm_alone.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


class App:
    """`serve run CONFIG` in a session of its own; `stop` sends SIGINT (Ctrl-C) and waits for a clean exit."""

    def __init__(self, config: Path, port: int, ray_tmp: Path, log: Path, timeout_s: float) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp)}
        self.port = port
        self.log = log
        self.proc = subprocess.Popen([str(REPO / ".venv-vllm" / "bin" / "serve"), "run", str(config)], cwd=REPO,
                                     env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                status, body = request(self.port, "GET", "/v1/models", None, 5)
                if status == 200 and json.loads(body)["data"]:
                    return
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                pass
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"the app did not answer /v1/models in {timeout_s:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self, timeout_s: float) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"serve run did not stop in {timeout_s:.0f} s after SIGINT") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def request(port: int, method: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def complete(port: int, model: str, prompt: str, max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy completion: TTFT (to the first text chunk), the text, the usage's cached tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    started = time.perf_counter()
    ttft, text, usage = None, [], None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - started
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    finally:
        conn.close()
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": int(details.get("cached_tokens") or 0)}


def warm_up(port: int, model: str, timeout_s: float) -> None:
    """One short request a fresh engine answers first: its first forward pass pays one-off costs (allocations,
    kernel selection) that would otherwise land on the first timed request."""
    complete(port, model, "warm up", 2, timeout_s)


def prompt_of(port: int, model: str, seed: int, tokens: int) -> str:
    """Random words (a seed's) cut to `tokens` tokens by the app's own /tokenize."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens * 2)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that stay within `tokens`
        mid = (lo + hi + 1) // 2
        status, body = request(port, "POST", "/tokenize", {"model": model, "prompt": " ".join(words[:mid])}, 60)
        if status != 200:
            raise RuntimeError(f"/tokenize answered {status}: {body[:300]!r}")
        if json.loads(body)["count"] <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def run_arm(kvcluster: bool, args, scratch: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="arm-", dir=scratch))
    port = free_port()
    config = app_config(workdir, port, kvcluster, args.kv_blocks, args.max_model_len)
    model = yaml.safe_load(config.read_text())["applications"][0]["args"]["model"]
    log = workdir / "serve.log"
    started = time.perf_counter()
    app = App(config, port, workdir / "ray", log, args.timeout_s)
    startup_s = time.perf_counter() - started
    warm_up(port, model, args.timeout_s)
    try:
        prompts = [prompt_of(port, model, seed, args.prompt_tokens) for seed in range(args.others + 1)]
        cold = complete(port, model, prompts[0], args.max_tokens, args.timeout_s)
        for other in prompts[1:]:
            complete(port, model, other, args.max_tokens, args.timeout_s)
        evicted = complete(port, model, prompts[0], args.max_tokens, args.timeout_s)
        restarted = None
        if kvcluster and not args.no_restart:
            app.stop(args.timeout_s)
            app = App(config, port, workdir / "ray", log, args.timeout_s)
            warm_up(port, model, args.timeout_s)
            restarted = complete(port, model, prompts[0], args.max_tokens, args.timeout_s)
        hot = complete(port, model, prompts[0], args.max_tokens, args.timeout_s)
    finally:
        try:
            app.stop(args.timeout_s)
        except RuntimeError:
            pass
    runs = {"cold": cold, "after_others": evicted, "after_restart": restarted, "hot": hot}
    return {
        "startup_s": startup_s,
        "prompt_tokens": cold["prompt_tokens"],
        **{f"ttft_{name}_s": r["ttft_s"] for name, r in runs.items() if r is not None},
        **{f"cached_{name}": r["cached_tokens"] for name, r in runs.items() if r is not None},
        "same_text": all(r["text"] == cold["text"] for r in runs.values() if r is not None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only one JSON document on stdout")
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="tokens of every prompt")
    parser.add_argument("--others", type=int, default=16, help="other prompts between the two asks of A")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens of every answer")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="override the config's kv_cache_blocks (smaller runs; default: as configured)")
    parser.add_argument("--max-model-len", type=int, default=None, help="override the config's max_model_len")
    parser.add_argument("--timeout-s", type=float, default=600, help="ceiling of each start, stop and request")
    parser.add_argument("--expect-hits", action="store_true",
                        help="exit 1 unless the kvcluster arm's prompt came back after the others and after the "
                             "restart (cached_tokens > 0) with the same text: what the README promises")
    parser.add_argument("--no-restart", action="store_true",
                        help="skip step 4 (stopping and starting the app: two engine starts instead of one)")
    parser.add_argument("--arms", default="kvcluster,vllm_alone",
                        help="comma-separated arms to run: kvcluster, vllm_alone (the reference; ratios need both)")
    args = parser.parse_args()
    for name in ("prompt_tokens", "others", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not wanted or set(wanted) - {"kvcluster", "vllm_alone"}:
        parser.error(f"--arms: choose from kvcluster, vllm_alone, got {args.arms!r}")
    with tempfile.TemporaryDirectory(prefix="kvc-first-", dir="/tmp") as scratch:
        arms = {name: run_arm(name == "kvcluster", args, Path(scratch)) for name in wanted}
    report = {"benchmark": "first_command", "config": "configs/serve.yaml", "prompt_tokens": args.prompt_tokens,
              "others": args.others, "arms": arms, "same_text": all(a["same_text"] for a in arms.values()),
              "clock": "wall time on this machine's CPU, one request each"}
    k, alone = arms.get("kvcluster"), arms.get("vllm_alone")
    if k is not None:
        report["cached_share_after_others"] = k["cached_after_others"] / k["prompt_tokens"]
        if "cached_after_restart" in k:
            report["cached_share_after_restart"] = k["cached_after_restart"] / k["prompt_tokens"]
            report["ttft_after_restart_vs_cold"] = k["ttft_cold_s"] / k["ttft_after_restart_s"]
    if k is not None and alone is not None:
        report["ttft_after_others_vs_vllm_alone"] = alone["ttft_after_others_s"] / k["ttft_after_others_s"]
    broken = []
    if not report["same_text"]:
        broken.append("a cached run's greedy text differs from the cold one")
    if args.expect_hits and k is not None:
        broken += [f"cached_tokens 0 {when}" for when, key in (("after the others", "cached_after_others"),
                                                               ("after the restart", "cached_after_restart"))
                   if k.get(key, 1) == 0]
    if args.json:
        print(json.dumps(report))
    else:
        for name, arm in arms.items():
            print(f"{name}: startup {arm['startup_s']:.1f} s, prompt {arm['prompt_tokens']} tokens")
            for run in ("cold", "after_others", "after_restart", "hot"):
                if f"ttft_{run}_s" in arm:
                    print(f"  {run:14s} TTFT {arm[f'ttft_{run}_s'] * 1000:8.1f} ms  cached {arm[f'cached_{run}']}")
        if "ttft_after_others_vs_vllm_alone" in report:
            print(f"kvcluster after the others: {report['ttft_after_others_vs_vllm_alone']:.2f}x faster than vLLM "
                  f"alone, cached {report['cached_share_after_others']:.0%}")
        if "ttft_after_restart_vs_cold" in report:
            print(f"kvcluster after a restart: {report['ttft_after_restart_vs_cold']:.2f}x faster than cold, "
                  f"cached {report['cached_share_after_restart']:.0%}")
        print(f"same greedy text in every run: {report['same_text']}")
    if broken:
        print("first_command: " + "; ".join(broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
