"""The shared trace files and the offline tokenizer tests read: present, or a failure under CI and a skip
elsewhere that says what is missing.

Why: a skip is silent in a green summary, so a CI machine without the traces (or without
the tokenizer every text trace loader needs) would pass while testing none of the loaders
and reference numbers that read them. A developer without them still gets a skip, with
the path and how to provide it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcluster.paths import shared_data_dir
from kvcluster.tokenizer import tokenizer_dir


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
    missing(f"shared data missing: {path} (set KVCLUSTER_DATA to the folder holding the traces, or put them in "
            "../shared/data beside the repository)")


def require_tokenizer() -> Path:
    """The offline tokenizer's folder ($KVCLUSTER_TOKENIZER_DIR, else <repo>/.cache/tokenizer).

    Missing tokenizer.json: fails the calling test under CI, else skips it; the message names
    the file and the script that creates it."""
    path = tokenizer_dir() / "tokenizer.json"
    if path.is_file():
        return path.parent
    missing(f"offline tokenizer missing: {path} (create it with `python scripts/fetch_tokenizer.py`, or set "
            "KVCLUSTER_TOKENIZER_DIR to a folder holding it)")


def missing(message: str) -> None:
    """Fail the calling test under CI, else skip it, with `message`."""
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
