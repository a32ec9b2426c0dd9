"""Finding a config by shipped name or path, and reading a YAML config into a pydantic model, with errors
that name the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import ConfigError
from .paths import configs_dir

M = TypeVar("M", bound=BaseModel)


def resolve_config(name_or_path: str | Path, folder: str, suffix: str, kind: str) -> Path:
    """A file path as given, else the shipped `configs/<folder>/<name><suffix>`; the error lists the shipped names."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = configs_dir() / folder / f"{name_or_path}{suffix}"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in (configs_dir() / folder).glob(f"*{suffix}")))
    raise ConfigError(f"unknown {kind} {str(name_or_path)!r}: not a file, and not one of: {names}")


def load_yaml_model(path: Path, model: type[M], kind: str) -> M:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"malformed {kind} file {path}: {exc}".replace("\n", " ")) from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ConfigError(f"{path}: field {where}: {first['msg']}") from None
