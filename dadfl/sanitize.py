"""``dadfl.sanitize`` — text that came from another party, made safe to log or echo: one line, bounded length."""

from __future__ import annotations

ECHO_CHARS = 80
REASON_CHARS = 300  # of a reason another party gives (a status, a step abort, a site leaving), when logged


def printable(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` quoted with every non-printable or non-ASCII character escaped (no newline can
    forge a log line) and cut to ``limit`` characters (a 1 MiB id cannot flood the log)."""
    shown = ascii(text[:limit])
    if len(text) > limit:
        shown += f"... ({len(text)} characters)"
    return shown


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """A message that embeds another party's text, made safe to log or send: every non-printable
    or non-ASCII character escaped (no quotes added), cut to ``limit`` characters."""
    shown = ascii(text[:limit])[1:-1]
    if len(text) > limit:
        shown += f"... ({len(text)} characters)"
    return shown
