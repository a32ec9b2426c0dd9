"""Where kvcluster finds its shipped configs and the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGED_CONFIGS = Path(__file__).resolve().parent / "_configs"  # what a wheel ships (setup.py)


def configs_dir() -> Path:
    """The configs folder: $KVCLUSTER_CONFIGS, else the checkout's configs/, else the copy a wheel installed."""
    if "KVCLUSTER_CONFIGS" in os.environ:
        return Path(os.environ["KVCLUSTER_CONFIGS"])
    checkout = REPO_ROOT / "configs"
    return checkout if checkout.is_dir() or not PACKAGED_CONFIGS.is_dir() else PACKAGED_CONFIGS


def shared_data_dir() -> Path:
    """The shared trace folder: $KVCLUSTER_DATA, else ../shared/data beside the repo."""
    return Path(os.environ.get("KVCLUSTER_DATA", REPO_ROOT.parent / "shared" / "data"))
