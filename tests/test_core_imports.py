"""The core never imports the layers above it: no module of `kvcluster/` imports `kvcluster.actors` or
`kvcluster.serve_apps` (installed from `actors/` and `serve_apps/`), whether at the top or inside a function.
The Ray side is reached at run time through names in config or entry points (e.g. `ClusterLink.store_factory`)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "kvcluster"
ABOVE = ("kvcluster.actors", "kvcluster.serve_apps")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` (or in `source`, as if it were there), relative ones resolved;
    `from X import y` counts as X and X.y."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, module))
            out.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return out


def above_core(name: str) -> bool:
    return any(name == above or name.startswith(above + ".") for above in ABOVE)


def forbidden(path: Path) -> list[str]:
    return [f"{path.relative_to(CORE.parent)}:{line} imports {name}" for line, name in imported(path)
            if above_core(name)]


def test_no_core_module_imports_the_actors_or_the_serve_apps() -> None:
    files = [p for p in CORE.rglob("*.py") if not {"actors", "serve_apps"} & set(p.relative_to(CORE).parts)]
    assert len(files) > 50
    found = [hit for path in sorted(files) for hit in forbidden(path)]
    assert not found, "the core imports the layers above it:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import() -> None:
    nested = CORE / "integrations" / "vllm" / "store.py"  # resolved as if it sat there: three dots reach kvcluster
    source = ("import kvcluster.actors.tier_actor\nfrom kvcluster import serve_apps\nfrom ... import actors\n"
              "def f():\n    from ...serve_apps.cluster_store import ClusterBlockStore\n"
              "from ...actors_like import x\nfrom . import store\n")
    hits = sorted((line, name) for line, name in imported(nested, source) if above_core(name))
    assert hits == [(1, "kvcluster.actors.tier_actor"), (2, "kvcluster.serve_apps"), (3, "kvcluster.actors"),
                    (5, "kvcluster.serve_apps.cluster_store"), (5, "kvcluster.serve_apps.cluster_store.ClusterBlockStore")]



class FakeCluster:
    """A cluster with no Ray: its store is the engine's own tiers, its index holds nothing."""

    joined: list = []

    def __init__(self, link) -> None:
        FakeCluster.joined.append(link.node)

    def store(self, local, block_bytes: int):
        return local

    def index(self):
        return self


def test_the_connector_s_cluster_store_comes_from_the_factory_its_config_names() -> None:
    from kvcluster.integrations.vllm.store import parse_config, release_store, shared_store

    config = parse_config({"tiers": [{"kind": "dram", "capacity": "1MiB"}],
                           "cluster": {"node": "n7", "store_factory": f"{__name__}:FakeCluster"}})
    try:
        shared = shared_store("factory-test", config, 4096)
        assert FakeCluster.joined == ["n7"] and shared.store is shared.local
    finally:
        release_store("factory-test")
