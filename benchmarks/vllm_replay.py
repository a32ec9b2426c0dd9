"""Multi-turn replays through vLLM, side by side in one run: vLLM's own prefix cache alone, vLLM +
vLLM's `ExampleConnector` (its file-backed reference connector), vLLM + kvcluster's `KVClusterConnector`.

The conversations are benchmarks/serving.py's (`replay_requests`: ShareGPT and SWE-agent from
../shared/data, the real assistant text as the next turn's history, turns whose prompt would not fit the
model's window dropped, which caps each conversation where its prompt outgrows the window). The first
`--conversations` of each dataset keep their first `--max-turns` turns, and the turns are interleaved the
way the text traces time them (conversation k starts at k x SESSION_GAP_S, its turns TURN_GAP_S apart), so
other conversations run between two turns of one, as on a shared server.

vLLM gets `--kv-blocks` blocks of paged KV (128 tokens each on CPU; a little more than one
window-long request), far less than the replay's working set, so its prefix cache evicts history that the
next turn needs. Each arm of each dataset runs in a fresh engine (and a fresh connector store or
directory), one request at a time, after one untimed 64-token warm-up request; with `--rounds` N, each
round runs the arms in turn and an arm's figures pool its N replays (each round's ratio is kept too):

- TTFT: from `add_request` to the engine step that returns the request's first token (scheduling, the
  connector's lookup and load, the prefill, the connector's saves of the prompt's blocks, which both
  connectors finish inside that step, the first sample);
- requests/s: requests over the wall time of the whole replay, each request decoding
  min(its real answer's length, `--max-new-tokens`) tokens greedily, end of sequence ignored (the time
  after the first token is `after_first_token_s_mean` per request);
- cached-token share: prompt tokens vLLM did not compute (its prefix cache plus a connector's load, as
  vLLM reports them in `num_cached_tokens`) over prompt tokens.

`ExampleConnector` keys what it stores by the whole prompt and loads only for a prompt it stored exactly
(vLLM's reference, not a prefix cache), so in a multi-turn replay it stores every prompt and loads none.

A fourth arm, `vllm_room_for_all`, is the ceiling rather than a competitor: vLLM alone with paged KV for the
whole working set, so its own prefix cache never evicts and every reusable block is there at no load cost.
No connector can beat it; `share_of_ceiling` says how much of its speed-up over vLLM alone kvcluster reaches.

The model is kvcluster's tiny Llama config (8 layers, 2 KV heads, float32: 1 MiB of KV per 128-token block)
with seeded random weights (load_format="dummy") and the offline tokenizer. With `--ttft-prompts` > 0 the
run ends with `kvcluster.integrations.vllm.ttft`'s check: the first token of a 1,000-token prompt whose
896-token prefix comes from kvcluster's dram tier (vLLM's cache reset) against the same prompt served from
vLLM's own prefix cache (p50 over `--ttft-prompts` prompts).

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_TARGET_DEVICE=cpu \\
        .venv-vllm/bin/python benchmarks/vllm_replay.py [--json] [--conversations 4] [--max-turns 8]
"""

from __future__ import annotations

import os

for _name, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                      ("VLLM_TARGET_DEVICE", "cpu"), ("OMP_NUM_THREADS", "1")):
    os.environ.setdefault(_name, _value)  # before torch and vLLM are imported: the worker in this process,
    # where the arms' connector stores (and their counters) live

import argparse  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import JsonOutput  # noqa: E402
from serving import pct, replay_requests  # noqa: E402

from kvcluster.integrations.vllm.ttft import measure as measure_ttft  # noqa: E402
from kvcluster.integrations.vllm.ttft import model_dir  # noqa: E402
from kvcluster.keys import KeySpace  # noqa: E402
from kvcluster.traces.text import SESSION_GAP_S, TURN_GAP_S  # noqa: E402

BLOCK = 128  # vLLM's block size on CPU
MAX_MODEL_LEN = 4096  # the tiny Llama's max_position_embeddings
ARMS = ("vllm", "vllm+example_connector", "vllm+kvcluster", "vllm_room_for_all")
CEILING = "vllm_room_for_all"  # vLLM alone with KV room for the whole working set: no eviction, no loads
GOAL_SPEEDUP = 1.7


@dataclass(frozen=True)
class Turn:
    session: str
    index: int  # the turn's place in its conversation
    prompt: list[int]
    answer_tokens: int


def select_turns(requests: list[tuple[str, list[int], int]], conversations: int, max_turns: int) -> list[Turn]:
    """The first `conversations` sessions' first `max_turns` turns, in the text traces' arrival order."""
    order: list[str] = []
    turns: list[Turn] = []
    for session, prompt, answer in requests:
        if session not in order:
            if len(order) == conversations:
                break
            order.append(session)
        index = sum(t.session == session for t in turns)
        if index < max_turns:
            turns.append(Turn(session, index, prompt, answer))
    arrival = {s: k * SESSION_GAP_S for k, s in enumerate(order)}
    return sorted(turns, key=lambda t: (arrival[t.session] + t.index * TURN_GAP_S, order.index(t.session)))


def working_set_blocks(turns: list[Turn]) -> int:
    """Distinct full 128-token prefix blocks over the replay: what a cache holding everything would keep."""
    space = KeySpace(model="vllm-replay")
    return len({k for t in turns for k in space.chain_token_ids(t.prompt, BLOCK)})


def _connector(arm: str, work: Path, dram_mib: int, background: bool = True) -> dict | None:
    if arm == "vllm+example_connector":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(work)}}
    if arm == "vllm+kvcluster":
        return {"kv_connector": "KVClusterConnector",
                "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"tiers": [{"kind": "dram", "capacity": f"{dram_mib}MiB"}],
                                              "async_loads": background, "async_saves": background}}
    return None


def _engine(model: Path, arm: str, work: Path, kv_blocks: int, dram_mib: int, background: bool = True):
    from vllm import LLM

    transfer = _connector(arm, work, dram_mib, background)
    kw = {} if transfer is None else {"kv_transfer_config": transfer}
    return LLM(model=str(model), load_format="dummy", enforce_eager=True, dtype="float32", seed=0,
               enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=kv_blocks, **kw)


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _serve(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT, cached prompt tokens) of one request, run to its end alone in the engine."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                cached = out.num_cached_tokens or 0
    if ttft is None:
        raise RuntimeError(f"request {request_id} finished without a token")
    return ttft, cached


def _kvcluster_counts(before: set[str]) -> dict:
    from kvcluster.integrations.vllm.store import engine_stores

    new = [s for e, s in engine_stores().items() if e not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected one new kvcluster store for the engine, found {len(new)}")
    s = new[0]
    return {"loaded_blocks": s.loaded_blocks, "saved_blocks": s.saved_blocks, "failed_blocks": s.failed_blocks}


@dataclass(frozen=True)
class ArmRun:
    """One arm's replay of one dataset in one fresh engine."""

    ttfts: list[float]
    wall_s: float
    cached_tokens: int
    prompt_tokens: int
    counts: dict  # what the connector moved or stored


def run_arm(arm: str, turns: list[Turn], model: Path, kv_blocks: int, dram_mib: int, max_new: int,
            background: bool = True) -> ArmRun:
    """One arm over one dataset's turns, from a fresh engine and fresh connector storage."""
    from kvcluster.integrations.vllm.store import engine_stores

    with tempfile.TemporaryDirectory(prefix="kvcluster-vllm-replay-") as work:
        before = set(engine_stores())
        llm = _engine(model, arm, Path(work), kv_blocks, dram_mib, background)
        engine = llm.llm_engine
        _serve(engine, "warmup", [3 + (7 * i) % 31000 for i in range(64)], 1)
        ttfts, cached = [], 0
        t0 = time.perf_counter()
        for n, turn in enumerate(turns):
            seconds, hit = _serve(engine, f"r{n}", turn.prompt, max(1, min(turn.answer_tokens, max_new)))
            ttfts.append(seconds)
            cached += hit
        wall = time.perf_counter() - t0
        counts = _kvcluster_counts(before) if arm == "vllm+kvcluster" else {}
        if arm == "vllm+example_connector":  # a folder per distinct prompt it saved (keyed by its full blocks)
            counts = {"stored_prompt_folders": sum(1 for p in Path(work).iterdir() if p.is_dir())}
        _close(llm)
    return ArmRun(ttfts, wall, cached, sum(len(t.prompt) for t in turns), counts)


def summarize(runs: list[ArmRun]) -> dict:
    """An arm's figures over all its rounds' requests, and each round's own."""
    ttfts = [t for r in runs for t in r.ttfts]
    wall = sum(r.wall_s for r in runs)
    return {"requests_per_s": len(ttfts) / wall, "wall_s": wall, "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99), "after_first_token_s_mean": (wall - sum(ttfts)) / len(ttfts),
            "cached_token_share": sum(r.cached_tokens for r in runs) / sum(r.prompt_tokens for r in runs),
            "rounds": [{"requests_per_s": len(r.ttfts) / r.wall_s, "ttft_p50_s": pct(r.ttfts, 50), **r.counts}
                       for r in runs]}


def bench_dataset(dataset: str, args, model: Path) -> dict:
    """Every round runs the arms in turn, so each arm sees the machine at nearly the same moments."""
    turns = select_turns(replay_requests(dataset, 10 ** 9, MAX_MODEL_LEN - args.max_new_tokens),
                         args.conversations, args.max_turns)
    runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
    room = working_set_blocks(turns) + MAX_MODEL_LEN // BLOCK + 2  # every block of the replay, and a window
    for _ in range(args.rounds):
        for arm in ARMS:
            blocks = max(args.kv_blocks, room) if arm == CEILING else args.kv_blocks
            runs[arm].append(run_arm(arm, turns, model, blocks, args.dram_mib, args.max_new_tokens,
                                     not args.sync_transfers))
    arms = {arm: summarize(r) for arm, r in runs.items()}
    base, example, ours = arms["vllm"], arms["vllm+example_connector"], arms["vllm+kvcluster"]
    for r in arms.values():
        r["requests_per_s_vs_vllm"] = r["requests_per_s"] / base["requests_per_s"]
        r["ttft_p50_vs_vllm"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["requests_per_s_vs_vllm_rounds"] = [a["requests_per_s"] / b["requests_per_s"]
                                              for a, b in zip(r["rounds"], base["rounds"])]
    ceiling_gain = arms[CEILING]["requests_per_s"] - base["requests_per_s"]
    return {"dataset": dataset, "requests": len(turns), "conversations": len({t.session for t in turns}),
            "mean_prompt_tokens": sum(len(t.prompt) for t in turns) / len(turns),
            "max_prompt_tokens": max(len(t.prompt) for t in turns),
            "working_set_blocks": working_set_blocks(turns), "ceiling_kv_blocks": max(args.kv_blocks, room),
            "arms": arms,
            "share_of_ceiling": (ours["requests_per_s"] - base["requests_per_s"]) / ceiling_gain
            if ceiling_gain > 0 else None,
            "goal_speedup_met": ours["requests_per_s_vs_vllm"] >= GOAL_SPEEDUP,
            "goal_ttft_p50_ahead_of_example_met": ours["ttft_p50_s"] < example["ttft_p50_s"]}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--datasets", nargs="+", choices=("sharegpt", "swe-agent"), default=["sharegpt", "swe-agent"])
    parser.add_argument("--conversations", type=_positive, default=4, help="conversations per dataset")
    parser.add_argument("--max-turns", type=_positive, default=8, help="turns replayed per conversation")
    parser.add_argument("--max-new-tokens", type=_positive, default=16, help="decode cap per request")
    parser.add_argument("--kv-blocks", type=int, default=36,
                        help="vLLM's paged KV blocks (num_gpu_blocks_override); >= 33 for a 4,096-token window")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="replays of each dataset, the arms in turn each round (figures pool all rounds)")
    parser.add_argument("--dram-mib", type=_positive, default=512, help="kvcluster's dram tier (1 MiB a block)")
    parser.add_argument("--sync-transfers", action="store_true",
                        help="kvcluster's loads and saves inside the engine step (async_loads/async_saves off)")
    parser.add_argument("--ttft-prompts", type=int, default=3,
                        help="prompts of the dram-vs-vLLM-prefix-cache TTFT check (0 skips it)")
    args = parser.parse_args(argv)
    if args.kv_blocks * BLOCK < MAX_MODEL_LEN + BLOCK:
        parser.error(f"--kv-blocks must be >= {MAX_MODEL_LEN // BLOCK + 1}: one window-long request and vLLM's "
                     f"null block")
    if args.max_new_tokens >= MAX_MODEL_LEN // 2:
        parser.error(f"--max-new-tokens must be < {MAX_MODEL_LEN // 2}")
    if args.ttft_prompts < 0:
        parser.error("--ttft-prompts must be >= 0")
    return args


def print_table(report: dict) -> None:
    print(f"vLLM KV: {report['kv_blocks']} blocks of {BLOCK} tokens; kvcluster dram tier {report['dram_mib']} MiB")
    for d in report["replays"]:
        print(f"\n{d['dataset']}: {d['requests']} requests, {d['conversations']} conversations, mean prompt "
              f"{d['mean_prompt_tokens']:.0f} tokens (max {d['max_prompt_tokens']}), working set "
              f"{d['working_set_blocks']} blocks")
        print(f"{'arm':24s} {'req/s':>7s} {'x vLLM':>7s} {'TTFT p50':>9s} {'p99':>8s} {'x vLLM':>7s} {'cached':>7s}")
        for arm, r in d["arms"].items():
            print(f"{arm:24s} {r['requests_per_s']:7.2f} {r['requests_per_s_vs_vllm']:7.2f} "
                  f"{r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p99_s'] * 1e3:6.0f}ms {r['ttft_p50_vs_vllm']:7.2f} "
                  f"{r['cached_token_share']:7.1%}")
        if d["share_of_ceiling"] is not None:
            print(f"kvcluster reaches {d['share_of_ceiling']:.0%} of the speed-up of vLLM with room for the whole "
                  f"working set ({d['ceiling_kv_blocks']} blocks)")
        if report["rounds"] > 1:
            per_round = ", ".join(f"{x:.2f}" for x in d["arms"]["vllm+kvcluster"]["requests_per_s_vs_vllm_rounds"])
            print(f"kvcluster req/s x vLLM by round: {per_round}")
        print(f"goal kvcluster >= {GOAL_SPEEDUP}x vLLM req/s: {'met' if d['goal_speedup_met'] else 'missed'}; "
              f"TTFT p50 ahead of ExampleConnector: {'met' if d['goal_ttft_p50_ahead_of_example_met'] else 'missed'}")
    t = report.get("ttft_check")
    if t:
        p = t["ttft_p50_s"]
        print(f"\nTTFT, {t['prompt_tokens']}-token prompt (p50 of {t['prompts']}): vLLM prefix cache "
              f"{p['vllm_prefix_cache'] * 1e3:.1f} ms, kvcluster dram {p['kvcluster_dram'] * 1e3:.1f} ms "
              f"({t['dram_vs_vllm_prefix_cache']:.2f}x, goal <= 1.5x), recomputed {p['recomputed'] * 1e3:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = JsonOutput(args.json)
    report: dict = {"kv_blocks": args.kv_blocks, "block_tokens": BLOCK, "dram_mib": args.dram_mib,
                    "max_new_tokens": args.max_new_tokens, "max_model_len": MAX_MODEL_LEN,
                    "conversations": args.conversations, "max_turns": args.max_turns, "rounds": args.rounds,
                    "kvcluster_transfers": "sync" if args.sync_transfers else "async"}
    with tempfile.TemporaryDirectory(prefix="kvcluster-vllm-replay-model-") as tmp:
        model = model_dir(Path(tmp) / "model")
        report["replays"] = [bench_dataset(d, args, model) for d in args.datasets]
        if args.ttft_prompts:
            check = measure_ttft(1000, args.ttft_prompts, Path(tmp) / "ttft")
            p = check["ttft_p50_s"]
            check["dram_vs_vllm_prefix_cache"] = p["kvcluster_dram"] / p["vllm_prefix_cache"]
            check["goal_met"] = check["dram_vs_vllm_prefix_cache"] <= 1.5
            report["ttft_check"] = check
    if out.enabled:
        out.emit(report, indent=1)
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
