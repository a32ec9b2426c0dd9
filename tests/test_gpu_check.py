"""benchmarks/gpu_check.sh: one line and exit 0 without CUDA; the dry run exercises every section on the CPU;
scripts/prepare_gpu_machine.py installs recompressed wheels offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
PREPARE = REPO / "scripts" / "prepare_gpu_machine.py"
SECTIONS = ("hbm", "paged", "nvme", "nixl", "serving", "sizing")
DRY_LABEL = "cpu (dry run, not a GPU result)"


def run(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env}
    full_env.pop("OUT", None)  # the report path comes from GPU_CHECK_JSON here
    full_env.pop("GPU_CHECK_DRY", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    report = tmp_path / "gpu_check.json"
    done = run(timeout=120, GPU_CHECK_JSON=str(report))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 0, done.stderr
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), lines
    assert not report.exists()


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    done = run("--dry-run", timeout=180, GPU_CHECK_JSON=str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(path.read_text()), done.stdout


def figures(node: object) -> list[float]:
    """Every number in a section (booleans are not figures)."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in figures(v)]
    if isinstance(node, list):
        return [x for v in node for x in figures(v)]
    return [node] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def test_dry_run_has_every_section_with_figures_or_a_reason(dry_report: tuple[dict, str]) -> None:
    report, stdout = dry_report
    assert report["device"] == DRY_LABEL and report["environment"]["dry_run"] is True
    assert set(report["sections"]) == set(SECTIONS)
    for name, section in report["sections"].items():
        assert section["device"] == DRY_LABEL, name
        assert section["status"] in ("ok", "skipped"), (name, section.get("error"), section.get("traceback"))
        if section["status"] == "skipped":
            assert section["skipped"], name
        else:
            assert figures(section), name
        assert any(line.startswith(name) for line in stdout.splitlines()), (name, stdout)


def test_dry_run_labels_every_figure(dry_report: tuple[dict, str]) -> None:
    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            if any(isinstance(v, float) for v in node.values()):
                assert node.get("device") == DRY_LABEL, where
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    walk(dry_report[0]["sections"], "sections")


def test_dry_run_serving_is_greedy_equal_with_and_without_the_cache(dry_report: tuple[dict, str]) -> None:
    serving = dry_report[0]["sections"]["serving"]
    assert serving["status"] == "ok", serving.get("error")
    assert serving["greedy_equal"] is True
    assert serving["prefix_fully_cached"] is True
    assert serving["raw_model_reference"]["greedy_equal_to_cold_runner"] is True
    assert serving["ttft_cold_s"] > 0 and serving["ttft_prefix_in_dram_s"] > 0


def test_dry_run_moves_and_sizes_are_right(dry_report: tuple[dict, str]) -> None:
    sections = dry_report[0]["sections"]
    assert sections["hbm"]["bytes_verified"] is True
    assert sections["paged"]["bytes_verified"] is True and sections["paged"]["row_order_verified"] is True
    assert sections["nvme"]["bytes_verified"] is True and sections["nvme"]["io_path_used"]
    if sections["nixl"]["status"] == "ok":
        assert sections["nixl"]["bytes_verified"] is True
        assert sections["nixl"]["rdma_backend_to_hbm"]["bytes_verified"] is True
    else:
        assert "nixl" in sections["nixl"]["skipped"]
    assert sections["sizing"]["exact"] is True  # on the CPU: the cache's tensor bytes


def test_the_model_view_passes_the_cache_under_the_name_transformers_takes() -> None:
    """A GPU image may ship transformers 5.17 (`past_key_values=`): the runner's own call and the check's
    `cache=` calls both reach the model with the cache, never None."""
    import sys

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_serving import RunnerModel
    finally:
        sys.path.pop(0)

    class OldModel(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids.device, past_key_values, kwargs

    view = RunnerModel(OldModel(), "cpu")
    cache = object()
    assert view.cache_kwarg == "past_key_values"
    assert view(input_ids=torch.zeros(1, 2, dtype=torch.long), past_key_values=cache)[1] is cache
    assert view(input_ids=torch.zeros(1, 2, dtype=torch.long), cache=cache, use_cache=True)[1:] == (cache, {})


def probe_wheel(directory: Path) -> Path:
    """A one-module wheel (`kvc_probe.VALUE == 7`), stored uncompressed as a downloaded wheel may be."""
    wheel = directory / "kvc_probe-1.0-py3-none-any.whl"
    info = "kvc_probe-1.0.dist-info"
    files = {"kvc_probe.py": "VALUE = 7\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: kvc-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def test_a_recompressed_wheel_keeps_its_files_and_installs_offline(tmp_path: Path) -> None:
    sys.path.insert(0, str(PREPARE.parent))
    try:
        from prepare_gpu_machine import recompress
    finally:
        sys.path.pop(0)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = probe_wheel(wheels)
    with zipfile.ZipFile(wheel) as z:
        before = {i.filename: z.read(i) for i in z.infolist()}
    recompress(wheel)
    with zipfile.ZipFile(wheel) as z:
        assert {i.filename: z.read(i) for i in z.infolist()} == before
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_LZMA}
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, str(PREPARE), "install", str(wheels), "--target", str(site)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == wheel.name
    probe = subprocess.run([sys.executable, "-c", "import kvc_probe; print(kvc_probe.VALUE)"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.stdout.strip() == "7", probe.stderr


def test_install_without_wheels_says_so(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(PREPARE), "install", str(tmp_path), "--target", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == f"prepare_gpu_machine: no wheels in {tmp_path}"
