"""``dadfl.failures`` — how a command fails: one line on stderr, never a local variable or a secret.

``dadfl --debug ...`` (or ``--debug`` after a command) adds the traceback: frames and source
lines only, as Python prints them, with every registered secret (a site's token) redacted.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

import typer

REDACTED = "<redacted>"
ERROR_CHARS = 500

_state = {"debug": False}
_secrets: set[str] = set()


def set_debug(on: bool) -> None:
    if on:
        _state["debug"] = True


def keep_secret(text: str) -> None:
    """Never print ``text`` (a token), whatever message it ends up in."""
    if text:
        _secrets.add(text)


def redact(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    return text


def fail(message: str, code: int = 2, exc: BaseException | None = None) -> NoReturn:
    """Print ``error: message`` (and, with ``--debug``, ``exc``'s traceback) and exit with ``code``."""
    if _state["debug"] and exc is not None:
        sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    typer.echo(f"error: {redact(message)}", err=True)
    raise typer.Exit(code)


def unexpected(exc: BaseException) -> NoReturn:
    """An error no check foresaw: its type and first line, exit 1."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:ERROR_CHARS] if lines else ""
    hint = "" if _state["debug"] else " (run with --debug for the traceback)"
    fail(f"{type(exc).__name__}: {first}{hint}", 1, exc)
