"""Extract the Mistral-7B tokenizer from the mistral-common wheel into .cache/tokenizer.

Runs at setup time only (pip fetches the wheel from the package registry); the
package itself is never installed (it would pin numpy < 2.4). Idempotent.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvcluster.tokenizer import tokenizer_dir  # noqa: E402

WHEEL_MEMBER = "mistral_common/data/tokenizer.model.v1"


def main() -> int:
    dest = tokenizer_dir()
    if (dest / "tokenizer.json").is_file():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "mistral-common==1.13.1", "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("mistral_common-*.whl"))
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        with zipfile.ZipFile(wheel) as z:
            (model_dir / "tokenizer.model").write_bytes(z.read(WHEEL_MEMBER))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if len(tokenizer) != 32000:
            raise SystemExit(f"unexpected vocabulary size {len(tokenizer)}")
        dest.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(dest))
    print(f"tokenizer ready in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
