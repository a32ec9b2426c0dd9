"""Builds the one native module, kvcluster.storage._copyhash (copy and read with the tiers' checksum computed on the way).

Everything else lives in pyproject.toml. The module is optional: without a C compiler
the install still succeeds and kvcluster.storage.copyhash falls back to numpy
(same digests, slower), and says so in its KERNEL.
"""

from setuptools import Extension, setup

NATIVE = "kvcluster/storage/native"

setup(
    ext_modules=[
        Extension(
            "kvcluster.storage._copyhash",
            sources=[f"{NATIVE}/copyhash.c", f"{NATIVE}/kernel_base.c", f"{NATIVE}/kernel_avx2.c"],
            depends=[f"{NATIVE}/kernel.h"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
