"""``dadfl.options`` — options of strategies and workload factories, checked against their declared types.

Strict types (no ``"4"`` for an int), finite and bounded numbers, bounded strings, no
unknown names. A site applies this to what the coordinator sends; the coordinator to its
own config, so a typo fails at start rather than mid-run.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from typing import Annotated, Any, Callable

from pydantic import ConfigDict, Field, ValidationError, create_model

from dadfl.sanitize import one_line

log = logging.getLogger("dadfl.options")

MAX_TEXT_CHARS = 256  # one string option
BOUNDED = {
    int: Annotated[int, Field(strict=True, ge=-(2**31), lt=2**31)],
    float: Annotated[float, Field(allow_inf_nan=False, ge=-1e30, le=1e30)],
    str: Annotated[str, Field(strict=True, max_length=MAX_TEXT_CHARS)],
    bool: Annotated[bool, Field(strict=True)],
}


def typed_options(parameters: dict[str, tuple[Any, Any]], options: dict[str, Any], what: str) -> dict[str, Any]:
    """``options`` checked against ``{name: (annotation, default)}``; ValueError naming ``what``
    and every problem. Unannotated parameters (``Any``) take any value."""
    fields = {name: (BOUNDED.get(annotation, annotation), default) for name, (annotation, default) in parameters.items()}
    model = create_model("Options", __config__=ConfigDict(extra="forbid", strict=True), **fields)
    try:
        return model.model_validate(options).model_dump(include=set(options))
    except ValidationError as exc:
        raise ValueError(f"{what}: {validation_summary(exc)}") from None


def strategy_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """Options of the strategy dataclass ``cls``, typed as its fields are."""
    hints = typing.get_type_hints(cls)
    parameters = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}
    return typed_options(parameters, options, f"{cls.name} options")


def factory_options(factory: Callable, options: dict[str, Any], what: str) -> dict[str, Any]:
    """Options of a workload factory, typed as its signature is (a ``**kwargs`` factory: as given)."""
    signature = inspect.signature(factory)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return options
    try:
        hints = typing.get_type_hints(factory)
    except Exception as exc:  # annotations that do not resolve: check names only, and say so
        log.warning(
            "%s: the annotations of %s do not resolve (%s: %s), so its options are checked by name only, not by type",
            what, getattr(factory, "__qualname__", "the factory"), type(exc).__name__, one_line(str(exc), 200),
        )
        hints = {}
    parameters = {
        name: (hints.get(name, Any), ... if p.default is p.empty else p.default) for name, p in signature.parameters.items()
    }
    return typed_options(parameters, options, what)


def validation_summary(exc: ValidationError) -> str:
    """Every problem on one line, without the offending values."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors(include_input=False, include_url=False)
    )
