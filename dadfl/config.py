"""``dadfl.config`` — TOML configuration files validated by pydantic, with errors that name file, field and fix."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .sanitize import ECHO_CHARS, printable

Model = TypeVar("Model", bound=BaseModel)
SECRET_FIELDS = {"token"}  # never echoed, even when invalid
# ``training.precision``: the autocast of the sites' forward/backward (strategies/precision.py).
Precision = Literal["fp32", "bf16", "fp16"]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and how to fix it."""


class StrictModel(BaseModel):
    """Base of every config section: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})$")


def check_host_port(address: str, lowest_port: int = 1) -> str:
    """``address`` when it is ``host:port`` with a port in ``lowest_port``..65535 (gRPC would
    otherwise pick a port silently: 443 when there is none, a random one when out of range)."""
    match = HOST_PORT.match(address)
    if match is None:
        raise ValueError("write host:port, e.g. 127.0.0.1:50051 or [::1]:50051")
    port = int(match.group(2))
    if not lowest_port <= port <= 65535:
        raise ValueError(f"port {port} is outside {lowest_port}..65535")
    return address


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
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        if error["type"] == "extra_forbidden":
            hint = "remove it or check its spelling"
        elif error["type"] == "missing":
            hint = "add it"
        elif field in SECRET_FIELDS:
            hint = "value not shown"
        else:
            value = error.get("input")
            hint = f"got {printable(value) if isinstance(value, str) else repr(value)[:ECHO_CHARS]}"
        problems.append(f"field '{field}': {error['msg']} ({hint})")
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return "\n".join([f"{source}: {len(problems)} problems in the configuration", *(f"  {p}" for p in problems)])
