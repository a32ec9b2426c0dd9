"""What a cluster config leaves on disk, and removing it (`kvcluster cluster down --purge`).

A cluster's tiers keep files that outlive the actors: each node's nvme slab
(`<nvme path>/<node>/kvcluster-nvme.slab`, reused but never read back: its slot
index lives in memory, so a new cluster starts it empty) and its owner's pid
(`kvcluster-nvme.slab.owner`, left behind only by a process that died holding the
slab: `kvcluster.storage.slab_owner`), the shared filesystem's
block files (`<pfs path>/kv/`, read back by design: content-addressed blocks serve
any later cluster of the same model) and the predictor's checkpoint
(`<checkpoint_dir>/predictor.json`). Purging removes exactly those, never other
files a user keeps in the same directories.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .cluster_config import ClusterConfig

NVME_SLAB = "kvcluster-nvme.slab"
NVME_OWNER = NVME_SLAB + ".owner"  # slab_owner.owner_file's name; kept here so the CLI loads no storage code
PREDICTOR_CHECKPOINT = "predictor.json"


def state_paths(cfg: ClusterConfig) -> list[Path]:
    """The files and directories this config's cluster writes, existing or not, in a stable order."""
    paths: list[Path] = []
    for node in cfg.nodes:
        for tier in node.tiers:
            if tier.path is None:
                continue
            if tier.kind == "nvme":
                paths += [Path(tier.path) / node.name / NVME_SLAB, Path(tier.path) / node.name / NVME_OWNER]
            elif tier.kind == "pfs":
                paths.append(Path(tier.path) / "kv")
    paths.append(Path(cfg.checkpoint_dir) / PREDICTOR_CHECKPOINT)
    return list(dict.fromkeys(paths))  # a shared pfs path is named by every node: once


def purge(cfg: ClusterConfig) -> list[str]:
    """Remove every state file of `cfg` that exists; the paths removed. Run only with the cluster down."""
    removed = []
    for path in state_paths(cfg):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(str(path))
    return removed
