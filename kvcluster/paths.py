"""Where kvcluster finds its shipped configs and the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def configs_dir() -> Path:
    """The configs/ folder: $KVCLUSTER_CONFIGS, else the one beside the package."""
    return Path(os.environ.get("KVCLUSTER_CONFIGS", REPO_ROOT / "configs"))


def shared_data_dir() -> Path:
    """The shared trace folder: $KVCLUSTER_DATA, else ../shared/data beside the repo."""
    return Path(os.environ.get("KVCLUSTER_DATA", REPO_ROOT.parent / "shared" / "data"))
