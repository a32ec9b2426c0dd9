"""The offline tokenizer: Mistral-7B's SentencePiece vocabulary (32,000 tokens).

`scripts/fetch_tokenizer.py` extracts it at setup time from the `mistral-common`
wheel on PyPI (which ships `tokenizer.model.v1`) and saves it as a fast
`tokenizer.json`; nothing is downloaded at run time.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError
from .paths import REPO_ROOT


def tokenizer_dir() -> Path:
    return Path(os.environ.get("KVCLUSTER_TOKENIZER_DIR", REPO_ROOT / ".cache" / "tokenizer"))


def _require() -> Path:
    path = tokenizer_dir()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"no tokenizer in {path}; run `bash scripts/setup.sh` (it extracts one offline)")
    return path


@lru_cache(maxsize=1)
def load_fast_tokenizer():
    """The raw `tokenizers.Tokenizer` (batch encoding for trace loading)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_require() / "tokenizer.json"))


def load_tokenizer():
    """A transformers tokenizer for serving (chat template, decode, special tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_require()))
