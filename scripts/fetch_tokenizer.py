"""Set up the offline tokenizer: Mistral-7B's tokenizer.model from the mistral-common wheel.

Runs at setup time only. pip downloads the wheel from the package registry
(`pip download --no-deps`); the package is never installed (it would pin
numpy < 2.4). The file is checked against its SHA-256, written as
`tokenizer.model` with a LlamaTokenizer config, and converted once to a fast
`tokenizer.json` (the conversion needs sentencepiece and protobuf; loading it
later needs neither). Idempotent: a second run only checks the stamp.

    python scripts/fetch_tokenizer.py [--dest DIR] [--wheel mistral_common-*.whl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvcluster.tokenizer import VOCAB_SIZE, tokenizer_dir  # noqa: E402

WHEEL = "mistral-common==1.13.1"
MEMBER = "mistral_common/data/tokenizer.model.v1"
SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"  # Mistral-7B-v0.1 tokenizer.model
CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
    "model_max_length": 32768,
}
STAMP = ".fetched"


def stamp_text() -> str:
    return f"{WHEEL} {MEMBER} {SHA256} {json.dumps(CONFIG, sort_keys=True)}\n"


def fetch_wheel(tmp: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(tmp)], check=True)
    return next(tmp.glob("mistral_common-*.whl"))


def extract(wheel: Path, into: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        data = z.read(MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{wheel.name}:{MEMBER} has sha256 {digest}, expected {SHA256}")
    into.mkdir(parents=True, exist_ok=True)
    (into / "tokenizer.model").write_bytes(data)
    (into / "tokenizer_config.json").write_text(json.dumps(CONFIG, indent=2))


def convert(source: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if len(tokenizer) != VOCAB_SIZE or tokenizer("Hello")["input_ids"] != [1, 22557]:
        raise SystemExit(f"unexpected tokenizer: {len(tokenizer)} tokens, 'Hello' -> {tokenizer('Hello')['input_ids']}")
    tokenizer.save_pretrained(str(dest))
    (dest / "tokenizer.model").write_bytes((source / "tokenizer.model").read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=tokenizer_dir())
    parser.add_argument("--wheel", type=Path, help="a mistral_common wheel already on disk (skips pip download)")
    args = parser.parse_args(argv)
    dest: Path = args.dest
    if (dest / "tokenizer.json").is_file() and (dest / STAMP).is_file() and (dest / STAMP).read_text() == stamp_text():
        print(f"tokenizer already in {dest}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or fetch_wheel(Path(tmp))
        source = Path(tmp) / "source"
        extract(wheel, source)
        dest.mkdir(parents=True, exist_ok=True)
        convert(source, dest)
    (dest / STAMP).write_text(stamp_text())
    print(f"tokenizer ready in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
