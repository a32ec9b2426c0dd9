"""`kvcluster size` / `capacity`: published figures, JSON shape, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcluster.cli import main
from kvcluster.model_spec import load_model_spec
from kvcluster.sizing import decompressed_mla_bytes_per_token, size_model


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_deepseek_v3_latent_vs_naive(capsys) -> None:
    data = run_json(capsys, "size", "deepseek-v3", "--dtype", "bf16", "--json")
    assert data["bytes_per_token"] == 61 * 576 * 2
    assert data["naive_bytes_per_token"] == 61 * 2 * 128 * 128 * 2
    assert data["overprovision_ratio"] == pytest.approx(56.89, abs=0.01)
    assert {layer["kind"] for layer in data["layers"]} == {"mla"}
    spec = load_model_spec("deepseek-v3")
    assert decompressed_mla_bytes_per_token(spec, "bf16") == 61 * 40960 * 2  # ~71x, the pre-5.15 layout


@pytest.mark.parametrize(
    "model,per_token",
    [("llama-3.1-8b", 32 * 2 * 8 * 128 * 2), ("llama-3.1-70b", 80 * 2 * 8 * 128 * 2),
     ("falcon-7b", 32 * 2 * 1 * 64 * 2), ("gpt2", 12 * 2 * 12 * 64 * 4), ("qwen2.5-7b", 28 * 2 * 4 * 128 * 2)],
)
def test_published_per_token_bytes(model: str, per_token: int) -> None:
    assert size_model(load_model_spec(model)).bytes_per_token == per_token


def test_sliding_window_bounds_bytes_at_long_context() -> None:
    spec = load_model_spec("mistral-7b-v0.1")
    report = size_model(spec, dtype="bf16", context=32768)
    assert report.bytes_per_sequence == 32 * 2 * 8 * 128 * 2 * 4095
    assert report.overprovision_ratio == pytest.approx(32768 / 4095)


def test_gemma3_is_five_local_to_one_global() -> None:
    kinds = [layer.kind.value for layer in load_model_spec("gemma-3-27b").layers]
    assert kinds[:6] == ["sliding"] * 5 + ["full"] and kinds.count("full") == 10


def test_qwen3_next_has_fixed_linear_state() -> None:
    report = size_model(load_model_spec("qwen3-next-80b-a3b"), dtype="bf16", context=1000)
    linear = [layer for layer in report.layers if layer.kind == "linear"]
    assert len(linear) == 36 and all(layer.bytes_per_token == 0 and layer.fixed_bytes > 0 for layer in linear)
    assert size_model(load_model_spec("qwen3-next-80b-a3b"), dtype="bf16", context=2000).bytes_per_sequence - \
        report.bytes_per_sequence == 1000 * report.bytes_per_token


def test_hbm_budget_gives_max_sequences(capsys) -> None:
    data = run_json(capsys, "size", "llama-3.1-8b", "--context", "8192", "--hbm-gib", "80", "--json")
    budget = 80 * (1 << 30) - data["num_parameters"] * 2
    assert data["hbm"]["max_sequences"] == budget // (131072 * 8192)
    assert data["hbm"]["batch_gain"] == 1.0


def test_capacity_json_per_tier(capsys) -> None:
    data = run_json(capsys, "capacity", "llama-3.1-8b", "--tiers", "h100-node", "--json")
    assert [t["name"] for t in data["tiers"]] == ["hbm", "dram", "cxl", "nvme", "rdma", "pfs"]
    assert all(t["tokens"] == t["bytes"] // data["bytes_per_token"] for t in data["tiers"])
    assert data["total_tokens"] == sum(t["tokens"] for t in data["tiers"])


def test_hf_config_path_is_accepted(tmp_path: Path, capsys) -> None:
    src = json.loads(Path("configs/models/qwen3-8b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(src))
    assert run_json(capsys, "size", str(tmp_path), "--json")["bytes_per_token"] == 36 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["size", "no-such-model"], "unknown model"),
        (["size", "llama-3.1-8b", "--dtype", "int3"], "invalid choice"),
        (["size", "llama-3.1-8b", "--hbm-gib", "-4"], "must be >= 0"),
        (["size", "llama-3.1-8b", "--context", "0"], "positive integer"),
        (["size", "llama-3.1-70b", "--hbm-gib", "80"], "do not fit"),
        (["capacity", "llama-3.1-8b", "--tiers", "nope.yaml"], "unknown tiers file"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, fragment, capsys) -> None:
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_configs_exit_2(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["size", str(broken)]) == 2
    assert "malformed model config" in capsys.readouterr().err
    no_type = tmp_path / "config.json"
    no_type.write_text(json.dumps({"hidden_size": 8}))
    assert main(["size", str(tmp_path)]) == 2
    tiers = tmp_path / "t.yaml"
    tiers.write_text("name: x\ngpu: {name: g, count: 1, dense_bf16_tflops: 1}\ntiers:\n  - {kind: dram, medium: m, capacity: -1GiB, read_gbps: 1, write_gbps: 1, latency_us: 0}\n")
    assert main(["capacity", "gpt2", "--tiers", str(tiers)]) == 2
    assert "tiers.0.capacity" in capsys.readouterr().err
    tiers.write_text("name: x\ngpu: {name: g, count: 1, dense_bf16_tflops: 1}\nbogus: 1\ntiers: []\n")
    assert main(["capacity", "gpt2", "--tiers", str(tiers)]) == 2


def test_entry_point_runs_as_a_process() -> None:
    exe = Path(sys.executable).with_name("kvcluster")
    bad = subprocess.run([str(exe), "size", "no-such-model"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("kvcluster size: error: unknown model")
    good = subprocess.run([str(exe), "size", "gpt2"], capture_output=True, text=True)
    assert good.returncode == 0 and "overprovision ratio" in good.stdout


def exit_code(argv: list[str]) -> int:
    """main()'s return code, or argparse's exit code for usage errors."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)
