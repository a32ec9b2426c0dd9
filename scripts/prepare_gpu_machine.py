"""Prepare a GPU machine for benchmarks/gpu_check.py: the wheels its image lacks, fetched here, installed there.

The GPU image (Python 3.12, CUDA torch) has no registry and lacks pydantic (the
runner's configs) and NIXL; KvikIO is optional. Two steps:

    # on a machine with a registry: download, recompress the large ones (the device carry limit is 64 MiB)
    echo /benchmarks/gpu_wheels/ >> .git/info/exclude          # never committed
    .venv/bin/python scripts/prepare_gpu_machine.py fetch benchmarks/gpu_wheels [--with-kvikio]

    # on the GPU machine (benchmarks/gpu_check.sh does this): install them, offline, into a directory
    python3 scripts/prepare_gpu_machine.py install benchmarks/gpu_wheels --target /tmp/site

`install` prints the installed wheels' names on stdout, one line, for the report; the
caller puts the target on PYTHONPATH. Only the standard library is used: this runs
under the GPU image's Python before anything is installed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

GPU_WHEELS = [  # what the GPU image (python 3.12, torch cu130) lacks
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "nixl==1.5.1", "nixl-cu13==1.5.1",
]
KVIKIO_WHEELS = ["kvikio-cu13==26.10.0", "libkvikio-cu13==26.10.0", "rapids-logger==0.3.0"]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
RECOMPRESS_ABOVE = 4 << 20  # smaller wheels gain too little to be worth rewriting


def fetch(directory: Path, kvikio: bool) -> int:
    """Download the image's missing wheels for its platform into `directory`, large ones recompressed."""
    directory.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "-d", str(directory), *GPU_WHEELS, *(KVIKIO_WHEELS if kvikio else [])]
    if subprocess.call(cmd):
        return 1
    for wheel in directory.glob("*.whl"):
        if wheel.stat().st_size > RECOMPRESS_ABOVE:
            recompress(wheel)
    wheels = list(directory.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"prepare_gpu_machine: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {directory}")
    return 0


def recompress(wheel: Path) -> None:
    """Rewrite a wheel with LZMA (pip reads it; 56 -> 33 MiB for nixl-cu13): the device carry limit is 64 MiB."""
    tmp = wheel.with_suffix(".lzma")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_LZMA)
    tmp.replace(wheel)


def install(directory: Path, target: Path) -> int:
    """pip install every wheel in `directory` into `target`, offline; pip's output goes to `target`.log."""
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        print(f"prepare_gpu_machine: no wheels in {directory}", file=sys.stderr)
        return 1
    log = target.with_name(target.name + ".log")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(target), *map(str, wheels)]
    with open(log, "w") as out:
        if subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT):
            print(f"prepare_gpu_machine: installing {directory}/*.whl failed (log: {log})", file=sys.stderr)
            return 1
    print(" ".join(w.name for w in wheels))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download the wheels the GPU image lacks (needs a registry)")
    get.add_argument("directory", type=Path)
    get.add_argument("--with-kvikio", action="store_true", help="KvikIO too (~4 MiB)")
    put = sub.add_parser("install", help="install the fetched wheels offline into a directory")
    put.add_argument("directory", type=Path)
    put.add_argument("--target", type=Path, required=True, help="directory to install into (goes on PYTHONPATH)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        return fetch(args.directory, args.with_kvikio)
    return install(args.directory, args.target)


if __name__ == "__main__":
    sys.exit(main())
