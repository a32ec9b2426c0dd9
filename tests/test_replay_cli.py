"""`kvcluster replay`: JSON shape, tiers mode with reference deployments, plot, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcluster.cli import main

FIXTURE = str(Path(__file__).parent / "fixtures" / "traces" / "bailian.jsonl")


def run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code)
    captured = capsys.readouterr()
    data = json.loads(captured.out) if code == 0 and "--json" in argv else None
    return code, data, captured.err


def test_replay_json_shape(capsys) -> None:
    code, data, err = run(capsys, "replay", FIXTURE, "--policies", "lru,bayes,belady", "--capacity-blocks", "2,50", "--json")
    assert code == 0 and "skipped" in err
    assert {"trace", "requests", "block_refs", "results", "infinite_hit_rate"} <= set(data)
    assert len(data["results"]) == 6
    row = data["results"][0]
    assert {"policy", "capacity_blocks", "hit_rate", "per_tier", "projected_ttft_s"} <= set(row)
    big = [r for r in data["results"] if r["capacity_blocks"] == 50]
    assert all(r["hit_rate"] == pytest.approx(data["infinite_hit_rate"]) for r in big)


def test_replay_over_a_node_s_tiers_reports_references(capsys, tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    code, data, _ = run(capsys, "replay", FIXTURE, "--policy", "bayes", "--tiers", "laptop-cpu",
                        "--model", "kvcluster-tiny-llama", "--prefetch-lead-s", "1", "--plot", str(png), "--json")
    assert code == 0 and png.stat().st_size > 1000
    assert [t["name"] for t in data["results"][0]["tiers"]] == ["hbm", "dram", "cxl", "nvme", "rdma", "pfs"]
    assert [r["deployment"] for r in data["reference_deployments"]] == ["hbm-only-lru", "hbm-dram-lru"]
    assert "prefetch" in data["results"][0]
    # the embedded default's stand-in node names no prices: the report says which fields it lacks
    assert "cost" not in data["results"][0]
    assert data["unpriced"] == ["gpu.usd_per_gpu_hour"] + [f"tiers[{k}].usd_per_gib_month"
                                                           for k in ("dram", "cxl", "nvme", "rdma", "pfs")]


def test_replay_over_a_priced_node_reports_cost_per_million_prompt_tokens(capsys) -> None:
    from kvcluster.pricing import HOURS_PER_MONTH
    from kvcluster.tiers import GIB, load_node_tiers

    code, data, _ = run(capsys, "replay", FIXTURE, "--policy", "lru", "--tiers", "h100-node",
                        "--model", "kvcluster-tiny-llama", "--json")
    assert code == 0 and "unpriced" not in data
    node = load_node_tiers("h100-node")
    gpus = 8 * node.gpu.usd_per_gpu_hour
    per_tier = {t.kind: t.usable_bytes / GIB * t.usd_per_gib_month / HOURS_PER_MONTH for t in node.tiers[1:]}
    six, only_hbm, with_dram = data["results"][0], *data["reference_deployments"]
    assert only_hbm["cost"]["usd_per_hour"] == pytest.approx(gpus)
    assert with_dram["cost"]["usd_per_hour"] == pytest.approx(gpus + per_tier["dram"])
    assert six["cost"]["usd_per_hour"] == pytest.approx(gpus + sum(per_tier.values()))
    for row in (six, only_hbm, with_dram):
        tokens_per_hour = row["throughput"]["prefill_tokens_per_s"] * 3600
        assert row["cost"]["usd_per_million_prompt_tokens"] == pytest.approx(
            row["cost"]["usd_per_hour"] / tokens_per_hour * 1e6)
    assert main(["replay", FIXTURE, "--policy", "lru", "--tiers", "h100-node", "--model", "kvcluster-tiny-llama"]) == 0
    assert "USD/M prompt tok" in capsys.readouterr().out


def test_replay_calibration_reports_brier_and_reliability(capsys) -> None:
    code, data, _ = run(capsys, "replay", FIXTURE, "--policies", "sieve,bayes", "--capacity-blocks", "4",
                        "--calibration", "30", "--json")
    assert code == 0 and [r["policy"] for r in data["results"]] == ["sieve", "bayes"]
    cal = data["calibration"]
    assert cal["horizon_s"] == 30 and cal["references"] == data["block_refs"]
    assert 0 <= cal["brier"] <= 1 and 0 <= cal["brier_base_rate"] <= 0.25
    assert sum(r["count"] for r in cal["reliability"]) == cal["references"]
    assert all(0 <= r["predicted"] <= 1 and 0 <= r["observed"] <= 1 for r in cal["reliability"])
    code = main(["replay", FIXTURE, "--policy", "lru", "--capacity-blocks", "4", "--calibration"])
    out = capsys.readouterr().out
    assert code == 0 and "P(reuse within 60 s)" in out and "Brier" in out


def test_replay_lookahead_is_its_own_figure(capsys) -> None:
    code, data, _ = run(capsys, "replay", FIXTURE, "--policies", "lru,bayes", "--capacity-blocks", "3",
                        "--lookahead-s", "5", "--json")
    assert code == 0
    for r in data["results"]:
        assert r["lookahead"]["lookahead_s"] == 5 and 0 <= r["lookahead"]["hit_rate"] <= data["infinite_hit_rate"]
    code, plain, _ = run(capsys, "replay", FIXTURE, "--policies", "lru,bayes", "--capacity-blocks", "3", "--json")
    assert [r["hit_rate"] for r in plain["results"]] == [r["hit_rate"] for r in data["results"]]


def test_replay_answers_at_finish_tells_each_answer_after_its_store(capsys) -> None:
    """The vLLM connector's order: what `replay(answers_at_finish=True)` gives, which differs from the answers
    known at the store on a Claude Code session (tool calls and ends of turn)."""
    from data_support import require_data
    from kvcluster.hierarchy import TierPlan
    from kvcluster.simulator import prepare, replay
    from kvcluster.traces import load_trace

    path = str(require_data("weka_claude_code_traces", "trace_0017.json"))
    prepared = prepare(load_trace(path))
    cap = prepared.unique_blocks // 10
    code, data, _ = run(capsys, "replay", path, "--policies", "bayes", "--capacity-blocks", str(cap),
                        "--answers-at-finish", "--json")
    assert code == 0 and data["answers"] == "told after each request's store"
    told = replay(prepared, "bayes", [TierPlan("hbm", cap)], answers_at_finish=True).hit_rate
    known = replay(prepared, "bayes", [TierPlan("hbm", cap)]).hit_rate
    assert data["results"][0]["hit_rate"] == told != known


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["replay", FIXTURE, "--policy", "mru", "--capacity-blocks", "4"], "unknown policy"),
        (["replay", FIXTURE, "--policy", "lru"], "exactly one of"),
        (["replay", FIXTURE, "--policy", "lru", "--capacity-frac", "1.5"], "(0, 1]"),
        (["replay", "/no/such/file", "--policy", "lru", "--capacity-blocks", "4"], "trace not found"),
        (["replay", FIXTURE, "--policy", "lru", "--capacity-blocks", "4", "--strict"], "bailian.jsonl:4"),
        (["replay", FIXTURE, "--policy", "lru", "--capacity-blocks", "x"], "invalid"),
        (["replay", FIXTURE, "--policy", "lru", "--capacity-blocks", "4", "--calibration", "-1"], "--calibration"),
        (["replay", FIXTURE, "--policy", "lru", "--tiers", "laptop-cpu", "--lookahead-s", "1"], "--lookahead-s"),
        (["replay", FIXTURE, "--policy", "lru", "--tier-fracs", "0.1,0.2,0.3"],
         "--tier-fracs splits the tiers of a --live replay"),
        (["replay", FIXTURE, "--policy", "lru", "--topology", "local", "--tier-blocks", "4,4,4"], "--tier-blocks splits"),
        (["replay", FIXTURE, "--policy", "lru", "--tier-blocks", "4", "--tier-fracs", "0.1"], "not allowed with"),
    ],
)
def test_bad_replay_input_exits_2(capsys, argv, fragment) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_capacity_flags_mean_a_sweep_and_tier_flags_a_split(capsys) -> None:
    """One meaning per flag: three --capacity-frac values are three runs of the simulator, with or without
    --live never three tiers; the per-tier split of a live replay is --tier-fracs / --tier-blocks."""
    code, data, _ = run(capsys, "replay", FIXTURE, "--policy", "lru", "--capacity-frac", "0.1,0.5,1", "--json")
    assert code == 0 and len(data["results"]) == 3 and all(len(r["per_tier"]) == 1 for r in data["results"])
    code, _, err = run(capsys, "replay", FIXTURE, "--live", "--policy", "lru", "--capacity-frac", "0.1,0.5,1")
    assert code == 2 and "--capacity-frac sweeps" in err and "--tier-fracs" in err
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--capacity-frac F[,F...] capacities to sweep" in help_text
    assert "--tier-fracs F,F[,F...] with --live: the size of each tier" in help_text


def test_replay_part_keeps_one_part_of_the_sessions(capsys) -> None:
    from kvcluster.traces import load_trace
    from kvcluster.traces.split import part

    whole = load_trace(FIXTURE)
    counts = {}
    for which in ("tune", "validation", "all"):
        code, data, _ = run(capsys, "replay", FIXTURE, "--policy", "lru", "--capacity-blocks", "50", "--part", which,
                            "--json")
        assert code == 0 and data["part"] == which
        counts[which] = data["requests"]
        assert data["requests"] == len(part(whole, which).requests)
    assert counts["tune"] + counts["validation"] == counts["all"] and counts["tune"] and counts["validation"]
    code, _, err = run(capsys, "replay", FIXTURE, "--part", "train")
    assert code == 2 and "--part" in err
