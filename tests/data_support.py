"""The shared trace files tests read: present, or a failure under CI and a skip elsewhere that says what is missing.

Why: a skip is silent in a green summary, so a CI machine without the traces would pass
while testing none of the loaders and reference numbers that read them. A developer
without the folder still gets a skip, with the path and how to provide it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcluster.paths import shared_data_dir


def in_ci() -> bool:
    """CI runners (and `.ci/run`) set CI=true; unset, empty, 0 or false is a developer's machine."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_data(*parts: str) -> Path:
    """The shared data file or folder `parts` (under $KVCLUSTER_DATA, else ../shared/data beside the repo).

    Missing: fails the calling test under CI, else skips it; the message names the path and
    where the data is looked for."""
    path = shared_data_dir().joinpath(*parts)
    if path.exists():
        return path
    message = (f"shared data missing: {path} (set KVCLUSTER_DATA to the folder holding the traces, or put them in "
               "../shared/data beside the repository)")
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
