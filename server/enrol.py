"""``dadfl.server.enrol`` — site enrolment: tokens issued once, only their SHA-256 hashes stored; revocation.

The token file is JSON, rewritten atomically::

    {"sites": {"<site id>": {"sha256": "<hex>", "enrolled": "<iso time>", "cert_serial": "<hex>"}},
     "revoked": [{"site": "<site id>", "cert_serial": "<hex>", "revoked": "<iso time>"}]}

``cert_serial`` is present when ``dadfl enroll --cert`` issued the site a certificate.
Tokens are 256 random bits, so a plain SHA-256 is a safe hash (no dictionary to attack);
comparison is constant-time. The running server checks every join against the file as it
is at that moment (both the token and the certificate against one reading), so a site
enrolled while the server runs can join at once, and a revoked one cannot; a revoked site
that is connected is dropped at its next upload. It reads the file again only when it
changed, in a worker thread (:class:`Enrolment`): any peer can cause a join, and admitting
N sites must not parse the file N times on the event loop. The file is read only up to
``MAX_TOKENS_FILE_BYTES``. A running server never takes a missing file for an empty one: a
file deleted while it runs (even between the check for a change and the read) refuses every
join with the error a missing file gives at start, and connected sites keep the last good
reading, so deleting the file never reads as "every site revoked" nor as "nothing changed".
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import NamedTuple

from dadfl.sanitize import printable

SITE_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # use with re.fullmatch: "$" would admit a trailing newline
SITE_ID_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
MAX_TOKENS_FILE_BYTES = 16 << 20  # about 80,000 enrolled sites


class EnrolmentError(PermissionError):
    """A site that may not join; ``unknown`` tells an unenrolled site from a bad token."""

    def __init__(self, message: str, unknown: bool):
        super().__init__(message)
        self.unknown = unknown


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_file_error(path: Path, exc: OSError) -> ValueError:
    """Why the token file cannot be read, in the words every reader of it uses (at start, at a
    join, at an edit): missing, or there but not readable."""
    if isinstance(exc, FileNotFoundError):
        return ValueError(
            f"{path} does not exist; enrol the sites first (`dadfl enroll SITE --config <server config>` "
            "creates it) or point listen.tokens at the federation's tokens file"
        )
    return ValueError(f"{path}: cannot read the token file ({type(exc).__name__}); it must be a file the server may read")


class Enrolled(NamedTuple):
    """One reading of the token file: the enrolled sites and the revoked list."""

    sites: dict[str, dict]
    revoked: list[dict]


def read_enrolment(path: Path) -> Enrolled:
    """The enrolled sites and the revoked list (see the module's docstring); ValueError naming
    the file when it is missing, unreadable or not a token file ``dadfl enroll`` wrote."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise tokens_file_error(path, exc) from None
    if len(raw) > MAX_TOKENS_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_TOKENS_FILE_BYTES >> 20} MiB, more than a token file of any federation; check that listen.tokens names the file `dadfl enroll` writes")
    try:
        data = json.loads(raw)
        sites, revoked = data["sites"], data.get("revoked", [])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a dadfl token file ({type(exc).__name__}); re-enrol the sites with `dadfl enroll`") from None
    if not isinstance(sites, dict):
        raise ValueError(f"{path}: 'sites' is not a table of site ids; re-enrol the sites with `dadfl enroll`")
    for site_id, entry in sites.items():
        if not re.fullmatch(SITE_ID_PATTERN, site_id) or not isinstance(entry, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256"))):
            raise ValueError(f"{path}: the entry of site {printable(site_id)} is not one `dadfl enroll` writes; re-enrol it with `dadfl enroll --replace`")
    if not isinstance(revoked, list) or not all(isinstance(item, dict) for item in revoked):
        raise ValueError(f"{path}: 'revoked' is not a list of revoked sites; restore it from a backup or remove it")
    return Enrolled(sites, revoked)


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def check_tokens_file(path: Path) -> int:
    """At server start: the tokens file (``listen.tokens``) exists and reads; returns the number of sites."""
    try:
        return len(read_enrolment(path).sites)
    except ValueError as exc:
        raise ValueError(f"listen.tokens: {exc}") from None


def enroll(path: Path, site_id: str, replace: bool = False, cert_serial: int | None = None) -> str:
    """Issue a new token for ``site_id``, store its hash (and its certificate's serial), return
    the token (shown once). Replacing an enrolment revokes the old certificate."""
    if not re.fullmatch(SITE_ID_PATTERN, site_id):
        raise ValueError(f"site id {printable(site_id)} must be {SITE_ID_RULE}")
    sites, revoked = _enrolment_to_edit(path)
    if site_id in sites and not replace:
        raise ValueError(f"site {site_id!r} is already enrolled in {path}; pass --replace to issue a new token (the old one stops working)")
    if site_id in sites:
        revoked += _revoked_entries(site_id, sites[site_id])
    token = secrets.token_urlsafe(32)
    sites[site_id] = {"sha256": token_hash(token), "enrolled": now_text()}
    if cert_serial is not None:
        sites[site_id]["cert_serial"] = f"{cert_serial:x}"
    write_tokens(path, sites, revoked)
    return token


def revoke(path: Path, site_id: str) -> None:
    """Remove ``site_id``'s token and put its certificate on the revoked list."""
    sites, revoked = _enrolment_to_edit(path)
    if site_id not in sites:
        raise ValueError(f"site {printable(site_id)} is not enrolled in {path}; nothing to revoke")
    revoked += _revoked_entries(site_id, sites.pop(site_id))
    if not any(entry.get("site") == site_id for entry in revoked):
        revoked.append({"site": site_id, "revoked": now_text()})
    write_tokens(path, sites, revoked)


def _enrolment_to_edit(path: Path) -> Enrolled:
    """The reading ``dadfl enroll`` edits: no file yet is a federation with no sites."""
    return read_enrolment(path) if path.exists() else Enrolled({}, [])


def _revoked_entries(site_id: str, entry: dict) -> list[dict]:
    serial = entry.get("cert_serial")
    return [{"site": site_id, "cert_serial": serial, "revoked": now_text()}] if serial else []


def write_tokens(path: Path, sites: dict[str, dict], revoked: list[dict] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"sites": sites, "revoked": revoked or []}, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def verify(enrolled: Enrolled, site_id: str, token: str) -> None:
    """Raise :class:`EnrolmentError` with the reason unless ``token`` is ``site_id``'s token."""
    sites, revoked = enrolled
    entry = sites.get(site_id)
    if entry is None and any(item.get("site") == site_id for item in revoked):
        raise EnrolmentError(
            f"site {site_id!r} was revoked on this server; `dadfl enroll {site_id}` enrols it again with a new token",
            unknown=True,
        )
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


def verify_certificate(enrolled: Enrolled, site_id: str, serial: int) -> None:
    """Raise :class:`EnrolmentError` when the certificate ``serial`` presented for ``site_id``
    is revoked, or is not the one ``dadfl enroll --cert`` issued to the site."""
    sites, revoked = enrolled
    serial_text = f"{serial:x}"
    if any(item.get("cert_serial") == serial_text for item in revoked):
        raise EnrolmentError(f"the certificate of site {site_id!r} (serial {serial_text}) was revoked", unknown=False)
    issued = sites.get(site_id, {}).get("cert_serial")
    if issued is not None and issued != serial_text:
        raise EnrolmentError(
            f"site {site_id!r} presented certificate serial {serial_text} but was issued {issued}; "
            f"use the certificate `dadfl enroll {site_id} --cert` wrote",
            unknown=False,
        )


class Enrolment:
    """The token file as the running coordinator sees it, read again only when it changed.

    A version of the file is its (inode, modification time, size): ``write_tokens`` replaces
    the file, so a new version has a new inode even when it has the old one's size and lands
    in the same clock tick; an edit in place changes the time or the size. Checking costs one
    ``stat``; a new version is read in a worker thread, once however many joins and uploads
    wait for it. :meth:`for_join` is what a join is checked against (a file that is missing or
    does not read refuses joins until it is fixed). :meth:`revocation`
    tells whether a connected site's enrolment still stands: a site revoked (or re-enrolled
    with a new token) while connected is dropped at its next upload; a file that goes missing
    or stops reading keeps the last good reading for those.
    """

    def __init__(self, path: Path):
        self.path = path
        self._version: tuple[int, int, int] | None = None  # of the file last read; None: not read yet
        self._good = Enrolled({}, [])  # the last reading that succeeded
        self._failure: str | None = None  # why the file at _version does not read
        self._reading = asyncio.Lock()

    def _current_version(self) -> tuple[int, int, int]:
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise tokens_file_error(self.path, exc) from None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    async def _refresh(self) -> None:
        """Read the file again if it changed since the last reading; ValueError when it is
        missing or cannot be stat'ed now."""
        version = self._current_version()
        if version != self._version:
            async with self._reading:
                version = self._current_version()  # another caller may have read it meanwhile
                if version != self._version:
                    try:  # a file deleted since the stat fails here as a missing one
                        self._good, self._failure = await asyncio.to_thread(read_enrolment, self.path), None
                    except ValueError as exc:
                        self._failure = str(exc)
                    self._version = version

    async def for_join(self) -> Enrolled:
        """The reading a join is checked against; ValueError when the file is missing or does not read."""
        await self._refresh()
        if self._failure is not None:
            raise ValueError(self._failure)
        return self._good

    async def site_ids(self) -> list[str]:
        try:
            await self._refresh()
        except ValueError:
            pass  # the last good reading
        return list(self._good.sites)

    async def revocation(self, site_id: str, joined_with: str) -> str | None:
        """Why ``site_id``, which joined with token hash ``joined_with``, may no longer take part."""
        try:
            await self._refresh()
        except ValueError:
            pass  # the last good reading
        entry = self._good.sites.get(site_id)
        if entry is None:
            return f"site {site_id!r} was revoked on the server (`dadfl enroll --revoke`)"
        if not hmac.compare_digest(str(entry.get("sha256", "")), joined_with):
            return f"site {site_id!r} was enrolled again with a new token; reconnect with the new token"
        return None
