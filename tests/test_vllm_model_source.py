"""The vLLM app writes an embedded model (a configs/models name) to one path per content, so that a restarted app
computes the same block keys as the one before it (the connector's keys include the model's path)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from kvcluster.serve_apps.vllm_replica import model_source  # noqa: E402


def test_every_start_of_an_embedded_model_finds_the_same_directory(tmp_path) -> None:
    first, load_format = model_source("kvcluster-tiny-llama", tmp_path)
    again, _ = model_source("kvcluster-tiny-llama", tmp_path)
    assert first == again and load_format == "dummy"
    config = json.loads((tmp_path / "kvcluster-models" / first.rsplit("/", 1)[-1] / "config.json").read_text())
    assert config["model_type"] == "llama" and not any(k.startswith("_") for k in config)
    other, _ = model_source("kvcluster-tiny-mla", tmp_path)
    assert other != first  # another model, another directory
    assert [p.name for p in (tmp_path / "kvcluster-models").iterdir() if p.name.startswith(".")] == []


def test_a_checkpoint_directory_is_used_as_it_is(tmp_path) -> None:
    assert model_source(str(tmp_path)) == (str(tmp_path), "auto")
