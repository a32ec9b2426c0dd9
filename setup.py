"""Packages, shipped configs and the one native module (kvcluster.storage._copyhash: copy and read with the
tiers' checksum computed on the way).

`configs/` (models, tiers, clusters, the serve config, dashboards) ships inside the package as
`kvcluster._configs`, so an install outside a checkout finds `deepseek-v3` too (`kvcluster.paths`).
Everything else lives in pyproject.toml. The module is optional: without a C compiler
the install still succeeds and kvcluster.storage.copyhash falls back to numpy
(same digests, slower), and says so in its KERNEL.
"""

from setuptools import Extension, find_packages, setup

NATIVE = "kvcluster/storage/native"

setup(
    packages=find_packages(include=["kvcluster*"]) + ["kvcluster.actors", "kvcluster.serve_apps", "kvcluster._configs"],
    package_dir={"kvcluster.actors": "actors", "kvcluster.serve_apps": "serve_apps", "kvcluster._configs": "configs"},
    package_data={"kvcluster": ["py.typed"], "kvcluster._configs": ["*.yaml", "*/*.yaml", "*/*.json"]},
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
