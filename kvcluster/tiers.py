"""The one tier spec: what each kind of tier is, and how a node's tiers are written.

Every module that needs a set of tiers (their order, which ones lend their pool
over NIXL, which ones keep bytes on disk, which ones a node's tier actors run)
derives it from `TIER_KINDS` here, so adding or changing a kind is one edit.

A node (`NodeTiers`) is the same schema wherever it is written: a tiers file
(`configs/tiers/*.yaml`, a node type from published specs) or a node of a cluster
file (`configs/cluster/*.yaml`, which adds where it runs). So one file can feed the
cost model, the simulator's hierarchy and the live actors. A tier's bandwidth,
latency and medium may be left out: the kind's figures below fill them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, field_validator, model_validator
from pydantic_core import core_schema

from .config_files import load_yaml_model, resolve_config
from .errors import ConfigError

GB = 1e9
GIB = 1 << 30

# Sizes are written with their unit, e.g. `capacity: 512MiB` or `capacity: 1.5TiB`; binary (KiB, MiB, GiB, TiB,
# PiB) and decimal (KB, MB, GB, TB, PB: as datasheets write them) units, B for bytes. A bare number is refused: 4 could be bytes, MiB or GiB.
SIZE_UNITS: dict[str, int] = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50,
                              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_UNIT_BY_LOWER = {unit.lower(): factor for unit, factor in SIZE_UNITS.items()}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*$")
SIZE_EXAMPLE = "a number and a unit (B, KiB, MiB, GiB, TiB, PiB, or KB, MB, GB, TB, PB), e.g. 512MiB or 1.5TiB"


def parse_size(value: Any) -> int:
    """Bytes of a size written with its unit ('512MiB', '1.5 TiB', '4GB', '4096B'); a ValueError says what
    to write instead. Fractions of a byte round down."""
    if isinstance(value, bool) or not isinstance(value, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"{value!r} has no unit; write {SIZE_EXAMPLE}")
        raise ValueError(f"expected {SIZE_EXAMPLE}, got {value!r}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNIT_BY_LOWER:
        raise ValueError(f"{value!r} is not a size; write {SIZE_EXAMPLE}")
    nbytes = int(Fraction(match.group(1)) * _UNIT_BY_LOWER[match.group(2).lower()])
    if nbytes < 1:
        raise ValueError(f"{value!r}: a size must be at least one byte")
    return nbytes


def format_size(nbytes: int) -> str:
    """`nbytes` in the largest binary unit that writes it exactly ('512MiB', '1536MiB', '4097B');
    `parse_size` reads it back to the same bytes."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        if nbytes % SIZE_UNITS[unit] == 0:
            return f"{nbytes // SIZE_UNITS[unit]}{unit}"
    return f"{nbytes}B"


class ByteSize(int):
    """A size in bytes, written with its unit (`parse_size`) and written back the same way (`format_size`)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            parse_size, json_schema_input_schema=core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(format_size, return_schema=core_schema.str_schema()))


@dataclass(frozen=True)
class TierKind:
    """The static properties of one kind of tier, and its default figures.

    The defaults are rough values for one CPU box with local SSD (the embedded
    default setup), for local experiments; a node type from published specs
    (configs/tiers/h100-node.yaml) writes its own figures.
    """

    name: str
    medium: str  # default description of the hardware
    read_gbps: float  # default bandwidth into HBM, GB/s
    write_gbps: float  # default bandwidth from HBM into the tier, GB/s
    latency_us: float  # default per-transfer latency
    nixl: bool  # its tier actor's pool is a registered slab other processes read over NIXL
    durable: bool  # bytes live in files under a `path` and survive the actor's restart
    node_actor: bool  # a node's tier actor runs it (hbm lives in the replicas; rdma is other nodes' pools)


TIER_KINDS: tuple[TierKind, ...] = (  # fastest first: the order of every hierarchy
    TierKind("hbm", "process memory standing in for HBM", 10, 10, 1,
             nixl=False, durable=False, node_actor=False),
    TierKind("dram", "host memory pool", 8, 8, 5,
             nixl=True, durable=False, node_actor=True),
    TierKind("cxl", "host memory pool, reported as emulated CXL", 6, 6, 5,
             nixl=True, durable=False, node_actor=True),
    TierKind("nvme", "local SSD through POSIX files", 2, 1, 100,
             nixl=False, durable=True, node_actor=True),
    TierKind("rdma", "NIXL UCX over loopback to other Ray nodes", 6, 6, 20,
             nixl=False, durable=False, node_actor=False),
    TierKind("pfs", "a local directory standing in for a shared filesystem", 1, 0.5, 500,
             nixl=False, durable=True, node_actor=True),
)
KINDS: dict[str, TierKind] = {k.name: k for k in TIER_KINDS}
TIER_ORDER: tuple[str, ...] = tuple(KINDS)
NIXL_TIERS: tuple[str, ...] = tuple(k.name for k in TIER_KINDS if k.nixl)
DURABLE_TIERS: tuple[str, ...] = tuple(k.name for k in TIER_KINDS if k.durable)
NODE_TIERS: tuple[str, ...] = tuple(k.name for k in TIER_KINDS if k.node_actor)
TierName = Literal[TIER_ORDER]  # type: ignore[valid-type]


def tier_rank(location_tier: str) -> int:
    """Where a location's tier sorts, fastest first. A location's tier is a kind, or a kind and a part of it
    ("hbm/tp0-of-2": one tensor-parallel worker's lent pages), which sorts as its kind."""
    return TIER_ORDER.index(location_tier.split("/", 1)[0])

_OLD_FIELDS = {"tier": "kind", "capacity_gib": "capacity", "capacity_mib": "capacity"}  # the three schemas' names

_FROM_KIND = ("medium", "read_gbps", "write_gbps", "latency_us")


def _kind_figures(field: str) -> str:
    """'hbm 10, dram 8, ...': the kinds' defaults of one figure, for the field's description."""
    return ", ".join(f"{k.name} {getattr(k, field):g}" for k in TIER_KINDS)


def _require_source(price: float | None, source: str | None, field: str) -> None:
    """A price is only as good as where it comes from: refuse one without its source."""
    if price is not None and not source:
        raise ValueError(f"{field} needs a price_source that says where the price comes from")


class TierSpec(BaseModel):
    """One tier of a node: how much it holds, how fast a replica reaches it, and where its bytes live."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TierName = Field(description="Tier kind, fastest first: " + ", ".join(TIER_ORDER) + ".")
    capacity: ByteSize = Field(description="Raw capacity of the tier, with its unit: e.g. 512MiB, 4GiB, 1.5TiB "
                                           "(binary units; KB, MB, GB, TB, PB are decimal). Tier actors and the vLLM "
                                           "connector turn the usable part into block slots of the model's "
                                           "block payload.")
    usable_fraction: float = Field(1.0, gt=0, le=1, description="Share of the capacity given to the KV cache.")
    medium: str | None = Field(None, description="The hardware, e.g. 'DDR5-4800, 2 TB per node' (default: the "
                                                 "kind's).")
    read_gbps: float | None = Field(None, gt=0, description="Bandwidth into HBM for one replica, GB/s (1e9 B/s); "
                                    f"default: the kind's ({_kind_figures('read_gbps')}).")
    write_gbps: float | None = Field(None, gt=0, description="Bandwidth from HBM into the tier, GB/s; default: the "
                                     f"kind's ({_kind_figures('write_gbps')}).")
    latency_us: float | None = Field(None, ge=0, description="Per-transfer latency, microseconds; default: the "
                                     f"kind's ({_kind_figures('latency_us')}).")
    path: str | None = Field(None, description="Directory of a durable tier's files (nvme: local to the node; "
                                               "pfs: shared by all nodes); a cluster's nvme and pfs tiers need one.")
    usd_per_gib_month: float | None = Field(None, ge=0, description="Price of one GiB of the tier for a month (bought "
                                            "hardware: its price over the months it is written off); the replay's "
                                            "cost per million prompt tokens charges the usable part. Needs "
                                            "price_source.")
    price_source: str | None = Field(None, min_length=1, description="Where usd_per_gib_month comes from.")

    @model_validator(mode="after")
    def _price_cited(self) -> "TierSpec":
        _require_source(self.usd_per_gib_month, self.price_source, "usd_per_gib_month")
        return self

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """Fill the figures left out from the kind (an unknown kind is left for the field check to name); a
        field of the older tier schemas is named with what replaces it."""
        old = [f for f in _OLD_FIELDS if isinstance(data, dict) and f in data]
        if old:
            units = {"capacity_gib": "GiB", "capacity_mib": "MiB"}
            hint = ", ".join(f"{_OLD_FIELDS[f]}: {data[f]}{units.get(f, '')}" for f in old)
            raise ValueError(f"field {', '.join(old)}: a tier is written {{kind, capacity}} now, the capacity with "
                             f"its unit: {hint}")
        if isinstance(data, dict) and data.get("kind") in KINDS:
            kind = KINDS[data["kind"]]
            data = {**{f: getattr(kind, f) for f in _FROM_KIND}, **{k: v for k, v in data.items() if v is not None}}
        return data

    @property
    def name(self) -> str:
        return self.kind

    @property
    def kind_info(self) -> TierKind:
        """The kind's static properties (`TIER_KINDS`)."""
        return KINDS[self.kind]

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity * self.usable_fraction)

    def read_seconds(self, nbytes: int) -> float:
        """Time to bring `nbytes` from this tier into HBM."""
        return self.latency_us * 1e-6 + nbytes / (self.read_gbps * GB)

    def write_seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.write_gbps * GB)


T = TypeVar("T", bound=TierSpec)


def fastest_first(tiers: Iterable[T]) -> list[T]:
    """Each kind once, fastest first whatever order they are written in (every hierarchy reads them so): the one
    ordering rule of every list of tiers (a node's, a cluster node's, the vLLM connector's)."""
    tiers = list(tiers)
    kinds = [tier.kind for tier in tiers]
    repeated = sorted({k for k in kinds if kinds.count(k) > 1}, key=TIER_ORDER.index)
    if repeated:
        raise ValueError(f"field kind: each kind at most once, {', '.join(repeated)} repeats (tiers: {kinds})")
    return sorted(tiers, key=lambda t: TIER_ORDER.index(t.kind))


def check_tiers(tiers: Sequence[TierSpec], allowed: Sequence[str], who: str, memory_takes_path: bool = True) -> None:
    """A ValueError naming the field when a tier's kind is not one `who` runs, or a durable tier has no path
    (or, with `memory_takes_path` false, a memory tier has one)."""
    for tier in tiers:
        if tier.kind not in allowed:
            raise ValueError(f"field kind: {who} runs no {tier.kind} tier; choose from {', '.join(allowed)}")
        if tier.kind_info.durable and not tier.path:
            raise ValueError(f"tier {tier.kind}: field path: the {tier.kind} tier needs a directory")
        if not memory_takes_path and not tier.kind_info.durable and tier.path:
            raise ValueError(f"tier {tier.kind}: field path: the {tier.kind} tier keeps its bytes in memory and "
                             f"takes no path")


class GpuSpec(BaseModel):
    """The accelerator that computes prefill when a block misses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="e.g. 'H100 SXM5'.")
    count: int = Field(ge=1, description="GPUs per node.")
    dense_bf16_tflops: float = Field(gt=0, description="Dense BF16 peak per GPU, TFLOPS.")
    mfu: float = Field(0.5, gt=0, le=1, description="Achieved fraction of peak during prefill.")
    usd_per_gpu_hour: float | None = Field(None, ge=0, description="Price of one GPU for an hour (HBM included); "
                                           "the replay's cost per million prompt tokens needs it. Needs "
                                           "price_source.")
    price_source: str | None = Field(None, min_length=1, description="Where usd_per_gpu_hour comes from.")

    @model_validator(mode="after")
    def _price_cited(self) -> "GpuSpec":
        _require_source(self.usd_per_gpu_hour, self.price_source, "usd_per_gpu_hour")
        return self


class NodeTiers(BaseModel):
    """A node: its tiers, fastest first, and its GPUs. A cluster file's nodes are this plus where they run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Name of the node (in a cluster: in actor "
                                                                      "names and the index).")
    gpu: GpuSpec | None = Field(None, description="The node's accelerators (prefill compute); the cost model "
                                                  "needs it to project TTFT.")
    tiers: list[TierSpec] = Field(min_length=1, description="Tiers, each kind once, in any order "
                                                                  "(kept fastest first).")
    model_copies: int = Field(1, ge=1, description="Model replicas per node; each holds the weights in HBM.")

    @field_validator("tiers")
    @classmethod
    def _unique_fastest_first(cls, tiers: list[TierSpec]) -> list[TierSpec]:
        return fastest_first(tiers)

    def tier(self, name: str) -> TierSpec:
        for tier in self.tiers:
            if tier.kind == name:
                return tier
        raise ConfigError(f"node {self.name!r} has no tier {name!r}")

    def require_gpu(self) -> GpuSpec:
        if self.gpu is None:
            raise ConfigError(f"node {self.name!r}: field gpu: the cost model needs the node's GPUs")
        return self.gpu


def resolve_tiers_path(name_or_path: str) -> Path:
    return resolve_config(name_or_path, "tiers", ".yaml", "tiers file")


def load_node_tiers(name_or_path: str) -> NodeTiers:
    """Read and validate a tiers YAML (one node); errors name the file and the field."""
    return load_yaml_model(resolve_tiers_path(name_or_path), NodeTiers, "tiers")
