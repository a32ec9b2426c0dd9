"""Reading a YAML config into a pydantic model, with errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import ConfigError

M = TypeVar("M", bound=BaseModel)


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
