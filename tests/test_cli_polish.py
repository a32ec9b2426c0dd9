"""CLI help for every command, `kvcluster report` charts, progress defaults, and the generated config docs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvcluster.cli import _show_progress, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests" / "fixtures" / "traces" / "bailian.jsonl")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMANDS = ["size", "capacity", "replay", "report", "cluster"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_lists_every_command_with_examples(capsys) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert set(COMMANDS) <= set(subparsers())
    for name, sub in subparsers().items():
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10, f"{name} has no one-line description"
    assert "examples:" in out and "kvcluster report" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_describes_every_option(command: str, capsys) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and out.startswith(f"usage: kvcluster {command}")
    parser = subparsers()[command]
    assert parser.description and parser.epilog and "examples:" in parser.epilog
    for action in parser._actions:
        assert action.help and action.help != argparse.SUPPRESS, f"{command} {action.option_strings or action.dest}"


def test_progress_is_off_for_json_and_non_terminals(monkeypatch) -> None:
    ns = lambda **kw: argparse.Namespace(**{"progress": None, "json": False, **kw})  # noqa: E731
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert _show_progress(ns()) is True
    assert _show_progress(ns(json=True)) is False
    assert _show_progress(ns(json=True, progress=True)) is True
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert _show_progress(ns()) is False and _show_progress(ns(progress=False)) is False


def test_report_writes_three_pngs_and_json(capsys, tmp_path: Path) -> None:
    out_dir = tmp_path / "report"
    code, out, err = run(capsys, "report", FIXTURE, "--policies", "lru,bayes", "--capacity-frac", "0.2,0.5,1",
                         "--tiers", "laptop-cpu", "--model", "kvcluster-tiny-llama", "--out", str(out_dir))
    assert code == 0, err
    names = ["hit_rate_vs_capacity.png", "tier_occupancy.png", "ttft_distribution.png"]
    assert out.split() == [str(out_dir / n) for n in names] + [str(out_dir / "report.json")]
    for name in names:
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    report = json.loads((out_dir / "report.json").read_text())
    sweep = report["hit_rate_vs_capacity"]
    assert sweep["source"] == "replayed" and len(sweep["results"]) == 6
    runs = report["over_tiers"]["runs"]
    assert [r["label"] for r in runs] == ["lru", "bayes", "hbm-only-lru", "hbm-dram-lru"]
    lru = runs[0]
    assert list(lru["occupancy"]["tiers"]) == ["hbm", "dram", "cxl", "nvme", "rdma", "pfs"]
    assert lru["occupancy"]["request"][-1] == report["requests"] - 1
    final = sum(t["blocks"][-1] for t in lru["occupancy"]["tiers"].values())
    assert 0 < final <= report["unique_blocks"]
    assert lru["ttft_histogram_s"]["count"] == report["requests"]
    assert "ttft_s_values" not in lru


def test_report_from_a_saved_replay_json(capsys, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "replay", FIXTURE, "--policies", "lru,belady", "--capacity-blocks", "2,4", "--json")
    saved = tmp_path / "sweep.json"
    saved.write_text(out)
    code, out, _ = run(capsys, "report", "--replay-json", str(saved), "--out", str(tmp_path / "r"), "--json")
    assert code == 0
    files = json.loads(out)["files"]
    assert set(files) == {"hit_rate_vs_capacity", "report"}
    assert Path(files["hit_rate_vs_capacity"]).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--capacity-frac", "1.5"], "--capacity-frac"),
        (["--capacity-frac", "x"], "argument --capacity-frac"),
        (["--sample-every", "0"], "argument --sample-every"),
        (["--policies", "lru,mru"], "unknown policy 'mru'"),
        (["--tiers", "no-such-node"], "--tiers: unknown tiers file"),
        (["--model", "no-such-model"], "--model: unknown model"),
        (["--capacity-blocks", "2", "--capacity-frac", "0.1"], "not allowed with argument"),
    ],
)
def test_bad_report_options_exit_2_naming_the_field(argv, fragment, capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "report", FIXTURE, "--out", str(tmp_path / "r"), *argv)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert err.startswith("kvcluster report: error:")


def test_bad_report_inputs_exit_2(capsys, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run(capsys, "report", FIXTURE, "--out", str(a_file))
    assert code == 2 and "--out" in err and "not a directory" in err
    code, _, err = run(capsys, "report", "--out", str(tmp_path / "r"))
    assert code == 2 and "TRACE" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"trace": "t", "requests": 1, "block_refs": 1, "infinite_hit_rate": 0,
                               "results": [{"policy": "lru", "capacity_blocks": "many", "hit_rate": 0.1}]}))
    code, _, err = run(capsys, "report", "--replay-json", str(bad), "--out", str(tmp_path / "r"))
    assert code == 2 and "field results.0.capacity_blocks" in err


def test_config_docs_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert module.render() == committed, "docs/configuration.md is stale: run .venv/bin/python scripts/gen_config_docs.py"
    for name in ("ServeAppConfig", "AutoscalingSettings", "ClusterConfig", "NodeEntry", "TierSpec",
                 "TierActorConfig", "PredictorConfig", "NodeTiers", "SamplingParams", "CompletionRequest",
                 "ChatCompletionRequest"):
        assert f"### {name}\n" in committed
