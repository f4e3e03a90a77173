"""Site enrolment: tokens issued once, only their SHA-256 hashes stored.

The token file is JSON, ``{"sites": {"<site id>": {"sha256": "<hex>", "enrolled": "<iso time>"}}}``,
rewritten atomically. Tokens are 256 random bits, so a plain SHA-256 is a safe hash
(no dictionary to attack); comparison is constant-time. The server rereads the file at
every join, so a site enrolled while the server runs can join at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from pathlib import Path

SITE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class EnrolmentError(PermissionError):
    """A site that may not join; ``unknown`` tells an unenrolled site from a bad token."""

    def __init__(self, message: str, unknown: bool):
        super().__init__(message)
        self.unknown = unknown


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_tokens(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        sites = json.loads(path.read_text())["sites"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a dadfl token file ({exc}); re-enrol the sites with `dadfl enroll`") from None
    return sites


def enroll(path: Path, site_id: str, replace: bool = False) -> str:
    """Issue a new token for ``site_id``, store its hash, return the token (shown once)."""
    if not re.match(SITE_ID_PATTERN, site_id):
        raise ValueError(f"site id {site_id!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    sites = read_tokens(path)
    if site_id in sites and not replace:
        raise ValueError(f"site {site_id!r} is already enrolled in {path}; pass --replace to issue a new token (the old one stops working)")
    token = secrets.token_urlsafe(32)
    sites[site_id] = {"sha256": token_hash(token), "enrolled": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_tokens(path, sites)
    return token


def write_tokens(path: Path, sites: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"sites": sites}, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def verify(path: Path, site_id: str, token: str) -> None:
    """Raise :class:`EnrolmentError` with the reason unless ``token`` is ``site_id``'s token."""
    entry = read_tokens(path).get(site_id)
    if entry is None:
        raise EnrolmentError(
            f"site {site_id!r} is not enrolled on this server; run `dadfl enroll {site_id}` on the server "
            "and put the printed token in the site's config",
            unknown=True,
        )
    if not hmac.compare_digest(entry["sha256"], token_hash(token)):
        raise EnrolmentError(
            f"wrong token for site {site_id!r}; use the token `dadfl enroll` printed for it, or re-enrol with --replace",
            unknown=False,
        )
