"""TOML configuration files validated by pydantic, with errors that name file, field and fix."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and how to fix it."""


class StrictModel(BaseModel):
    """Base of every config section: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def load_config(path: str | Path, model: type[Model]) -> Model:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    return validate_config(data, model, source=str(path))


def validate_config(data: dict, model: type[Model], source: str) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source)) from None


def format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} problem(s) in the configuration"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        if error["type"] == "extra_forbidden":
            hint = "remove it or check its spelling"
        elif error["type"] == "missing":
            hint = "add it"
        else:
            hint = f"got {error.get('input')!r}"
        lines.append(f"  field '{field}': {error['msg']} ({hint})")
    return "\n".join(lines)
