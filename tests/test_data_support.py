"""tests/data_support.require_data: missing shared data fails under CI, skips elsewhere, and names the path."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_support import require_data


def test_missing_data_fails_under_ci_naming_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCLUSTER_DATA", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as failed:
        require_data("mooncake", "synthetic_trace.jsonl")
    assert str(tmp_path / "mooncake" / "synthetic_trace.jsonl") in str(failed.value)
    assert "KVCLUSTER_DATA" in str(failed.value)


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_missing_data_skips_outside_ci_naming_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       ci: str | None) -> None:
    monkeypatch.setenv("KVCLUSTER_DATA", str(tmp_path))
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_data("sharegpt_v3")
    assert str(tmp_path / "sharegpt_v3") in str(skipped.value) and "KVCLUSTER_DATA" in str(skipped.value)


@pytest.mark.parametrize("ci", [None, "true"])
def test_present_data_is_returned_in_and_outside_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    ci: str | None) -> None:
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "synthetic_trace.jsonl").write_text("{}\n")
    monkeypatch.setenv("KVCLUSTER_DATA", str(tmp_path))
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert require_data("mooncake", "synthetic_trace.jsonl") == tmp_path / "mooncake" / "synthetic_trace.jsonl"
    assert require_data("mooncake") == tmp_path / "mooncake"
