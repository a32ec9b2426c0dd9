"""The core (sizing, capacity, replay) runs with Ray, NIXL, Serve and matplotlib absent; configs ship in the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "fixtures" / "traces" / "bailian.jsonl"
ABSENT = ["ray", "nixl", "fastapi", "starlette", "matplotlib", "kvikio"]

# Each of these packages raises ImportError when imported, as if not installed.
BLOCKER = f"""
import sys
for name in {ABSENT!r}:
    sys.modules[name] = None
from kvcluster.cli import main
sys.exit(main(sys.argv[1:]))
"""


def core_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], capture_output=True, text=True, timeout=300)


def test_size_capacity_and_replay_run_without_the_cluster_packages() -> None:
    size = core_cli("size", "deepseek-v3", "--dtype", "bf16", "--json")
    assert size.returncode == 0, size.stderr
    assert json.loads(size.stdout)["bytes_per_token"] == 70272  # the MLA latent, as the sizing tests pin it
    capacity = core_cli("capacity", "llama-3.1-8b", "--tiers", "h100-node", "--json")
    assert capacity.returncode == 0, capacity.stderr
    replay = core_cli("replay", str(TRACE), "--policies", "lru,bayes", "--capacity-frac", "0.1", "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)
    plot = core_cli("replay", str(TRACE), "--policies", "lru", "--capacity-frac", "0.1", "--plot", "/tmp/x.png")
    assert plot.returncode == 2 and "pip install 'kvcluster[plots]'" in plot.stderr


def test_importing_the_core_loads_no_cluster_package() -> None:
    probe = ("import sys, kvcluster, kvcluster.sizing, kvcluster.simulator, kvcluster.storage, kvcluster.cli; "
             f"print(sorted(m for m in {ABSENT!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr


def test_control_actors_and_file_tiers_start_without_torch() -> None:
    """A node controller, the pool manager, a file tier's actor and the file backends never load torch (seconds
    and ~200 MB per Ray worker); the memory tiers load it when used."""
    probe = ("import sys, kvcluster.actors.node_control_actor, kvcluster.actors.pool_manager_actor, "
             "kvcluster.actors.index_actor, kvcluster.actors.predictor_actor, kvcluster.actors.tier_actor as t; "
             "from kvcluster.storage import PFSBackend, NVMeBackend, checksum; import tempfile; "
             "t._backend(t.TierActorConfig.of('n0', 'pfs', 4, 4096, tempfile.mkdtemp())); "
             "print('torch' in sys.modules); "
             "from kvcluster.storage import dram_backend; print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["False", "True"], run.stderr


def test_the_cluster_command_says_what_to_install_when_ray_is_absent(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: kvcluster-tiny-llama\ncheckpoint_dir: {tmp_path}\nnodes:\n"
                   "  - name: n0\n    tiers: [{kind: dram, capacity: 0.01GiB}]\n")
    out = core_cli("cluster", "status", str(cfg))
    assert out.returncode == 2 and "pip install 'kvcluster[cluster]'" in out.stderr


@pytest.mark.slow
def test_a_wheel_ships_the_configs_under_one_namespace_and_finds_them_outside_a_checkout(tmp_path: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("kvcluster-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvcluster/_configs/models/deepseek-v3.json" in names and "kvcluster/_configs/serve.yaml" in names
    assert "kvcluster/actors/tier_actor.py" in names and "kvcluster/serve_apps/app.py" in names
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"kvcluster"}, f"only the kvcluster namespace may land in site-packages, got {sorted(tops)}"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("from kvcluster.paths import configs_dir; from kvcluster.model_spec import load_model_spec; "
             "print(configs_dir()); print(load_model_spec('deepseek-v3').name)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-2000:]
    where, name = run.stdout.split()
    assert where == str(site / "kvcluster" / "_configs") and name
