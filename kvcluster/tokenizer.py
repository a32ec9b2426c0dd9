"""The offline tokenizer: Mistral-7B's SentencePiece vocabulary (32,000 tokens).

It is the serving model's tokenizer too (configs/models/kvcluster-tiny-llama.json
has vocab 32000). `scripts/fetch_tokenizer.py` extracts `tokenizer.model` at setup
time from the `mistral-common` wheel on PyPI and converts it to a fast
`tokenizer.json` in `.cache/tokenizer/` (or $KVCLUSTER_TOKENIZER_DIR); nothing is
downloaded at run time, and loading needs neither sentencepiece nor protobuf.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError
from .paths import REPO_ROOT

VOCAB_SIZE = 32000


def tokenizer_dir() -> Path:
    """$KVCLUSTER_TOKENIZER_DIR, else <repo>/.cache/tokenizer."""
    return Path(os.environ.get("KVCLUSTER_TOKENIZER_DIR", REPO_ROOT / ".cache" / "tokenizer"))


def _require() -> Path:
    path = tokenizer_dir()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"no tokenizer in {path}; run `python scripts/fetch_tokenizer.py` once "
                          "(setup: it fetches the mistral-common wheel and extracts the Mistral-7B tokenizer)")
    return path


@lru_cache(maxsize=1)
def load_fast_tokenizer():
    """The Rust `tokenizers.Tokenizer`: batch encoding for trace loading."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_require() / "tokenizer.json"))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise ConfigError(f"tokenizer in {tokenizer_dir()} has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer


def load_tokenizer():
    """A transformers tokenizer (LlamaTokenizer, fast) for serving: BOS handling, decode, special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_require()), local_files_only=True)
    if len(tokenizer) != VOCAB_SIZE:
        raise ConfigError(f"tokenizer in {tokenizer_dir()} has {len(tokenizer)} tokens, not {VOCAB_SIZE}")
    return tokenizer
