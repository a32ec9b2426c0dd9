"""Write docs/configuration.md from the pydantic models: one table per model.

    .venv/bin/python scripts/gen_config_docs.py           # regenerate docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check   # exit 1 if the committed file is stale

Field names, types, defaults, constraints and descriptions come from the models
themselves; only the section texts and the notes on custom validators are
written here. `tests/test_cli_polish.py` checks the committed file is exactly
what this script renders, so the reference never drifts from the code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"


@dataclass(frozen=True)
class Model:
    path: str  # module:Class
    where: str  # who reads it, from what


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    models: tuple[Model, ...]
    tables: tuple[str, ...] = ()  # names of functions here that render a table after the intro


SECTIONS = (
    Section(
        "Serve app",
        "The `args` of an application in a Serve config file (`configs/serve_runner.yaml`), validated by "
        "`kvcluster.serve_apps.app:build_app` before anything starts; a wrong field fails the deploy naming it.",
        (
            Model("kvcluster.serve_apps.config:ServeAppConfig", "`applications[].args` of `configs/serve_runner.yaml`."),
            Model("kvcluster.serve_apps.config:AutoscalingSettings", "`autoscaling` of `ServeAppConfig`; passed to Serve "
                                                           "as the replicas' autoscaling config."),
        ),
    ),
    Section(
        "Cluster YAML",
        "`configs/cluster/*.yaml`, read by `kvcluster cluster up|status|down`, by the Serve app's `cluster` "
        "field, by `kvcluster replay --live --cluster` and by `kvcluster replay --topology` (the simulator and "
        "the cost model over the first node's tiers) (`kvcluster/cluster_config.py:load_cluster_config`; errors "
        "name the file and the field). Its nodes and tiers are the one node and tier spec below.",
        (
            Model("kvcluster.cluster_config:ClusterConfig", "The whole file."),
            Model("kvcluster.cluster_config:NodeEntry", "Each entry of `nodes`: a [NodeTiers](#nodetiers) plus "
                                                        "`ray_resource`."),
        ),
    ),
    Section(
        "Node and tier spec",
        "One schema for a node and its tiers (`kvcluster/tiers.py`), written as a node of a cluster YAML or as a "
        "whole tiers YAML (`configs/tiers/*.yaml`: a node type from published hardware specs, read by "
        "`kvcluster capacity`, `kvcluster replay --tiers/--node` and `kvcluster report`; `load_node_tiers`). "
        "Each tier kind's static properties and default figures are defined once, in `TIER_KINDS`; every module "
        "that needs a set of tiers derives it from there. A tier's `medium`, `read_gbps`, `write_gbps` and "
        "`latency_us` left out take the kind's defaults (rough figures for one CPU box with a local SSD):",
        (
            Model("kvcluster.tiers:NodeTiers", "A whole tiers YAML, or each node of a cluster YAML."),
            Model("kvcluster.tiers:GpuSpec", "`gpu`: prefill compute for the cost model."),
            Model("kvcluster.tiers:TierSpec", "Each entry of a node's `tiers`."),
        ),
        tables=("tier_kinds_table",),
    ),
    Section(
        "vLLM app and connector",
        "The `args` of the vLLM Serve app (`configs/serve.yaml`, `kvcluster.serve_apps.vllm_app:build_app`), and "
        "the vLLM connector's `kv_connector_extra_config` (`kvcluster/integrations/vllm/store.py:parse_config`, "
        "checked when the engine starts; errors name the field). The connector's `tiers` are the one tier spec "
        "([TierSpec](#tierspec)): `{kind, capacity, path}`, the capacity a size with its unit, as in a cluster or "
        "tiers YAML. See docs/vllm.md.",
        (
            Model("kvcluster.serve_apps.vllm_config:VLLMAppConfig", "`applications[].args` of `configs/serve.yaml`."),
            Model("kvcluster.integrations.vllm.store:ConnectorConfig", "`connector` of `VLLMAppConfig`, or vLLM's "
                                                                       "`kv_transfer_config.kv_connector_extra_config`."),
            Model("kvcluster.integrations.vllm.store:ClusterLink", "`cluster` of `ConnectorConfig`."),
        ),
    ),
    Section(
        "Library and actor settings",
        "Not written in a YAML file today: built by code from the files above, or passed through the Python API.",
        (
            Model("kvcluster.predictor:PredictorConfig", "`ReusePredictor(config)`; `simulator.replay("
                                                         "predictor_config=...)`. The predictor actor started by "
                                                         "`kvcluster cluster up` uses the defaults."),
            Model("kvcluster.actors.tier_actor:TierActorConfig", "Built by `kvcluster cluster up` for each tier of each node "
                                                       "of the cluster YAML (its tier as written there; slots from "
                                                       "the model's block payload)."),
            Model("kvcluster.serving.sampling:SamplingParams", "Built by the ingress from an OpenAI request; the "
                                                               "replica's model runner samples with it."),
        ),
    ),
    Section(
        "OpenAI requests",
        "Request bodies of the HTTP endpoint (`serve_apps/protocol.py`). An unknown field, a wrong type or a value "
        "out of range is a 400 naming the field in `param` (as vLLM's and OpenAI's servers answer); OpenAI fields "
        "kvcluster does not implement are accepted only at their neutral value, else a 400 naming them; an "
        "unknown model is a 404.",
        (
            Model("kvcluster.serve_apps.protocol:CompletionRequest", "`POST /v1/completions`."),
            Model("kvcluster.serve_apps.protocol:ChatCompletionRequest", "`POST /v1/chat/completions`."),
            Model("kvcluster.serving.chat:ChatMessage", "Each entry of `messages`."),
            Model("kvcluster.serve_apps.protocol:StreamOptions", "`stream_options`."),
            Model("kvcluster.serve_apps.protocol:TokenizeRequest", "`POST /tokenize`."),
            Model("kvcluster.serve_apps.protocol:DetokenizeRequest", "`POST /detokenize`."),
        ),
    ),
)

# What custom validators check (the models' own constraints are read from the fields).
VALIDATOR_NOTES = {
    "TierSpec": "`medium`, `read_gbps`, `write_gbps` and `latency_us` left out take the kind's defaults "
                "(table above)",
    "ServeAppConfig": "`block_tokens` is set here only for an app without a cluster",
    "NodeTiers.tiers": "each kind at most once; kept fastest first (hbm, dram, cxl, nvme, rdma, pfs)",
    "NodeEntry.tiers": "each kind at most once, kept fastest first; only kinds a node's tier actor runs (dram, "
                       "cxl, nvme, pfs); nvme and pfs need a `path`",
    "ConnectorConfig.tiers": "each kind at most once, kept fastest first; only dram, nvme, pfs; nvme and pfs "
                             "need a `path`, dram takes none",
    "TierActorConfig.tier": "only kinds a node's tier actor runs (dram, cxl, nvme, pfs); nvme and pfs need a "
                            "`path`",
    "TierActorConfig": "the tier holds at least one block of `slot_bytes`",
    "CompletionRequest.prompt": "token ids must be >= 0",
    "CompletionRequest.stop": "at most 4, none empty, each at most 256 characters",
    "ChatCompletionRequest.stop": "at most 4, none empty, each at most 256 characters",
    "ChatCompletionRequest.messages": "content parts must be of type text",
}
# Checks made outside the model (on loading, or by the server), worth knowing when writing the field.
EXTRA_NOTES = {
    "ClusterConfig": "When the actors start, every tier must hold at least one block of the model's payload "
                     "(`block_tokens` x bytes per token).",
    "ServeAppConfig": "With a cluster, the block size is the cluster YAML's (`block_tokens` there); the app's "
                      "model and dtype must give the same block bytes as the cluster's, or the replica refuses "
                      "to start.",
    "CompletionRequest": "Prompts x `n` is at most 128 (and at most the app's `max_inflight_requests`); "
                         "`max_tokens` above the app's `max_tokens_limit` or beyond the context window is a 400.",
    "ChatCompletionRequest": "`max_completion_tokens` wins over `max_tokens`; without either the app's "
                             "`default_chat_max_tokens` applies.",
}

# Descriptions of fields whose model gives none (better moved into the models' `Field(description=...)`;
# a field described in its model never reads from here, and a stale entry here is an error).
FALLBACK_DESCRIPTIONS = {
    "ServeAppConfig.dtype": "Weights and KV dtype of the replicas.",
    "ServeAppConfig.replica_cpus": "Ray CPUs reserved per replica (0: no reservation).",
    "ServeAppConfig.autoscaling": "Replica count bounds and target load.",
    "ServeAppConfig.default_chat_max_tokens": "Tokens a chat request generates at most when it sets no limit.",
    "AutoscalingSettings.min_replicas": "Replicas kept running at least.",
    "AutoscalingSettings.max_replicas": "Replicas started at most.",
    "AutoscalingSettings.target_ongoing_requests": "Ongoing requests per replica Serve scales towards.",
    "_Common.temperature": "Sampling temperature; 0 is greedy (default 1).",
    "_Common.top_p": "Nucleus sampling mass (default 1).",
    "_Common.n": "Choices per prompt (choice i samples with seed + i).",
    "_Common.stream": "Stream server-sent events ending in `data: [DONE]`.",
    "_Common.stream_options": "With `include_usage`, a final chunk carries the usage.",
    "_Common.stop": "Generation ends before any of these strings.",
    "_Common.seed": "Makes sampled output repeatable.",
    "_Common.user": "Accepted and ignored.",
    "_Common.ignore_eos": "Keep generating past the end-of-sequence token (benchmarks).",
    "CompletionRequest.max_tokens": "Tokens to generate at most.",
    "ChatCompletionRequest.messages": "The conversation; each message is tokenized on its own, so turn k is a "
                                      "prefix of turn k+1.",
    "ChatCompletionRequest.max_tokens": "Tokens to generate at most (older name).",
    "ChatCompletionRequest.max_completion_tokens": "Tokens to generate at most.",
    "ChatMessage.role": "Who wrote it; system/developer, user, assistant or tool.",
    "ChatMessage.content": "Text, or OpenAI content parts of type text.",
    "StreamOptions.include_usage": "Send a last chunk with `usage` before `[DONE]`.",
    "TokenizeRequest.model": "The served model's id; may be omitted.",
    "TokenizeRequest.prompt": "A text (give this or messages).",
    "TokenizeRequest.messages": "Chat messages, rendered as /v1/chat/completions renders them.",
    "DetokenizeRequest.model": "The served model's id; may be omitted.",
    "DetokenizeRequest.tokens": "Token ids to turn back into text.",
}


def fallback_description(cls, name: str) -> str:
    """From FALLBACK_DESCRIPTIONS, by the class that declares the field or any class it inherits it from."""
    for base in cls.__mro__:
        text = FALLBACK_DESCRIPTIONS.get(f"{base.__name__}.{name}")
        if text:
            return text
    return ""


def check_fallbacks() -> None:
    """Every fallback names an existing field that has no description of its own."""
    import kvcluster.serve_apps.protocol as protocol

    classes = {m.path.split(":")[1]: load(m.path) for s in SECTIONS for m in s.models}
    classes["_Common"] = protocol._Common
    for key in FALLBACK_DESCRIPTIONS:
        owner, name = key.split(".")
        field = classes[owner].model_fields.get(name) if owner in classes else None
        if field is None:
            raise SystemExit(f"FALLBACK_DESCRIPTIONS[{key!r}]: no such field")
        if field.description:
            raise SystemExit(f"FALLBACK_DESCRIPTIONS[{key!r}]: the model describes it now; remove the fallback")


def load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def anchor(name: str) -> str:
    return name.lower()


def type_name(tp, known: set[str]) -> str:
    """A readable type: `str | None`, `list[TierEntry]`, `"dram" | "cxl"`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a, known) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"tuple[{type_name(args[0], known)}, ...]"
    if origin is not None:
        inner = ", ".join(type_name(a, known) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else origin.__name__
    if isinstance(tp, type) and tp.__name__ == "ByteSize":  # kvcluster.tiers.ByteSize: written with its unit
        return "size (e.g. \"512MiB\", \"4GiB\", \"2TB\")"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`"


def nested_models(tp, known: set[str]) -> list[str]:
    """Names of the documented models inside an annotation, in order."""
    if isinstance(tp, type) and tp.__name__ in known:
        return [tp.__name__]
    return [n for a in typing.get_args(tp) for n in nested_models(a, known)]


def type_cell(tp, known: set[str]) -> str:
    links = ", ".join(f"[{n}](#{anchor(n)})" for n in dict.fromkeys(nested_models(tp, known)))
    return code(type_name(tp, known)) + (f" (see {links})" if links else "")


def default_cell(field) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return f"[{type(value).__name__}](#{anchor(type(value).__name__)}) defaults"
    if isinstance(value, tuple):
        value = list(value)
    return code(json.dumps(value))


def constraints_cell(owner: str, name: str, field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, label in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{label} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            parts.append(f"min length {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"max length {meta.max_length}")
        if getattr(meta, "pattern", None) is not None:
            parts.append(f"pattern {code(meta.pattern)}")
    note = VALIDATOR_NOTES.get(f"{owner}.{name}")
    if note:
        parts.append(cell(note))
    return "; ".join(parts)


def field_validators(cls) -> dict[str, str]:
    """Field name -> validator name, for validators declared on `cls` or its bases."""
    out = {}
    for dec in cls.__pydantic_decorators__.field_validators.values():
        for f in dec.info.fields:
            out[f] = dec.cls_var_name
    return out


def render_model(model: Model, known: set[str]) -> list[str]:
    cls = load(model.path)
    name = cls.__name__
    module, _ = model.path.split(":")
    lines = [f"### {name}", ""]
    doc = cls.__dict__.get("__doc__")
    if doc:
        lines += [" ".join(doc.split()), ""]
    extra = cls.model_config.get("extra")
    unknown = {"forbid": "rejected", "ignore": "ignored", "allow": "kept"}.get(extra or "ignore", str(extra))
    lines += [f"`{module.replace('.', '/')}.py:{name}`. {model.where} Unknown fields: {unknown}.", ""]
    lines += ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    validated = field_validators(cls)
    for fname, field in cls.model_fields.items():
        cons = constraints_cell(name, fname, field)
        if fname in validated and f"{name}.{fname}" not in VALIDATOR_NOTES:
            cons = "; ".join(filter(None, [cons, f"checked by `{validated[fname]}`"]))
        desc = cell(field.description or fallback_description(cls, fname))
        lines.append(f"| `{fname}` | {type_cell(field.annotation, known)} | {default_cell(field)} | {cons} | {desc} |")
    model_rule = VALIDATOR_NOTES.get(name)
    if model_rule is None and cls.__pydantic_decorators__.model_validators:
        model_rule = "checked by " + ", ".join(f"`{v}`" for v in cls.__pydantic_decorators__.model_validators)
    notes = [n for n in (f"Also: {model_rule}." if model_rule else None, EXTRA_NOTES.get(name)) if n]
    if notes:
        lines += ["", " ".join(notes)]
    return lines + [""]


def tier_kinds_table() -> list[str]:
    """The tier kinds, from `kvcluster.tiers.TIER_KINDS` (the one place they are defined)."""
    from kvcluster.tiers import TIER_KINDS

    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    rows = ["| kind | NIXL (memory pool lent) | durable (files under `path`) | node tier actor | default medium "
            "| read GB/s | write GB/s | latency us |", "|---|---|---|---|---|---|---|---|"]
    for k in TIER_KINDS:
        rows.append(f"| `{k.name}` | {yes(k.nixl)} | {yes(k.durable)} | {yes(k.node_actor)} | {cell(k.medium)} "
                    f"| {k.read_gbps:g} | {k.write_gbps:g} | {k.latency_us:g} |")
    return rows + [""]


def render() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    check_fallbacks()
    known = {m.path.split(":")[1] for s in SECTIONS for m in s.models}
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the pydantic models; do not edit by hand. -->",
        "",
        "Every file a user writes (Serve app args, cluster YAML, tiers YAML) and every HTTP request body is a "
        "pydantic v2 model; this page is generated from them (`.venv/bin/python scripts/gen_config_docs.py`). "
        "Defaults are shown as JSON (which is also YAML). Constraints: `>` `>=` `<` `<=` bound numbers, lengths "
        "bound strings and lists.",
        "",
    ]
    for section in SECTIONS:
        lines += [f"- [{section.title}](#{section.title.lower().replace(' ', '-')}): "
                  + ", ".join(f"[{m.path.split(':')[1]}](#{anchor(m.path.split(':')[1])})" for m in section.models)]
    lines.append("")
    for section in SECTIONS:
        lines += [f"## {section.title}", "", section.intro, ""]
        for table in section.tables:
            lines += globals()[table]()
        for model in section.models:
            lines += render_model(model, known)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run .venv/bin/python scripts/gen_config_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
