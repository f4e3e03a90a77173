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

from dadfl.sanitize import printable

SITE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
SITE_ID_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


class EnrolmentError(PermissionError):
    """A site that may not join; ``unknown`` tells an unenrolled site from a bad token."""

    def __init__(self, message: str, unknown: bool):
        super().__init__(message)
        self.unknown = unknown


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_tokens(path: Path) -> dict[str, dict]:
    """The enrolled sites (none when the file does not exist yet); ValueError naming the file
    when it is not a token file ``dadfl enroll`` wrote."""
    if not path.exists():
        return {}
    try:
        sites = json.loads(path.read_text())["sites"]
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(f"{path}: not a dadfl token file ({type(exc).__name__}); re-enrol the sites with `dadfl enroll`") from None
    if not isinstance(sites, dict):
        raise ValueError(f"{path}: 'sites' is not a table of site ids; re-enrol the sites with `dadfl enroll`")
    for site_id, entry in sites.items():
        if not re.match(SITE_ID_PATTERN, site_id) or not isinstance(entry, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256"))):
            raise ValueError(f"{path}: the entry of site {printable(site_id)} is not one `dadfl enroll` writes; re-enrol it with `dadfl enroll --replace`")
    return sites


def check_tokens_file(path: Path) -> int:
    """At server start: the tokens file (``listen.tokens``) exists and reads; returns the number of sites."""
    if not path.is_file():
        raise ValueError(
            f"listen.tokens: {path} does not exist; enrol the sites first (`dadfl enroll SITE --config <server config>` "
            "creates it) or point listen.tokens at the federation's tokens file"
        )
    try:
        return len(read_tokens(path))
    except ValueError as exc:
        raise ValueError(f"listen.tokens: {exc}") from None


def enroll(path: Path, site_id: str, replace: bool = False) -> str:
    """Issue a new token for ``site_id``, store its hash, return the token (shown once)."""
    if not re.match(SITE_ID_PATTERN, site_id):
        raise ValueError(f"site id {printable(site_id)} must be {SITE_ID_RULE}")
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
