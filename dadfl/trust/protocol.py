"""``dadfl.trust.protocol`` — protocol checks on every upload before the strategy's own checks see it.

An upload must answer the step, attempt and phase the server is running, be computed
from the server's current weights (the model version, by fingerprint), claim a sample
count within the configured batch size (per local step), and report a non-negative loss (a
non-finite loss, or tensor, is judged with the phase's other uploads: ``dadfl.trust.screening.model_fault``). What
its tensors may be is the strategy's to say (``Strategy.check_uploads``). Each failure
is a :class:`PayloadError` whose text says what was wrong; the coordinator drops that
site from the step and keeps running. The checks are a chain of steps
(:data:`PROTOCOL_CHECKS`), each taking the assembled upload and what the server expects
(:class:`Expected`) and returning the upload or refusing it; a new protocol check is one
more step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import Assembled
from dadfl.sanitize import printable


class PayloadError(ValueError):
    """An upload the coordinator refuses; the message says what was wrong."""


@dataclass(frozen=True)
class Expected:
    """What the server is running when an upload arrives: the upload must answer it."""

    step: int
    attempt: int
    phase: int
    fingerprint: str  # of the server's current weights
    max_samples: int  # the configured batch size, per local step


def check_kind(upload: Assembled, expected: Expected) -> Assembled:
    if upload.header.kind != pb.PHASE:
        raise PayloadError("expected a phase payload, got a state payload")
    return upload


def check_step(upload: Assembled, expected: Expected) -> Assembled:
    header = upload.header
    if (header.step, header.attempt) != (expected.step, expected.attempt):
        raise PayloadError(
            f"payload for step {header.step} (attempt {header.attempt}) while the server runs step {expected.step} (attempt {expected.attempt})"
        )
    if header.phase != expected.phase:
        raise PayloadError(f"payload for phase {header.phase} while the server waits for phase {expected.phase}")
    return upload


def check_model_version(upload: Assembled, expected: Expected) -> Assembled:
    base = upload.header.base_fingerprint
    if base != expected.fingerprint:
        raise PayloadError(
            f"payload computed from model version {printable(base[:12]) if base else '(none)'} but the current "
            f"model is {expected.fingerprint[:12]}: the site's weights are stale"
        )
    return upload


def check_counts(upload: Assembled, expected: Expected) -> Assembled:
    header, payload = upload.header, upload.payload
    if not 1 <= payload.num_samples <= expected.max_samples:
        raise PayloadError(f"num_samples={payload.num_samples} is outside 1..{expected.max_samples} (the configured batch size, per local step)")
    if header.loss_sum < 0:  # NaN passes: whose fault it is depends on the others (screening.model_fault)
        raise PayloadError(f"loss_sum={header.loss_sum!r} must be >= 0")
    if not payload.tensors:
        raise PayloadError("payload has no tensors")
    return upload


# In order: the first step that refuses names the problem.
PROTOCOL_CHECKS: tuple[Callable[[Assembled, Expected], Assembled], ...] = (check_kind, check_step, check_model_version, check_counts)


def check_protocol(upload: Assembled, step: int, attempt: int, phase: int, fingerprint: str, max_samples: int) -> Assembled:
    """``upload`` through every step of :data:`PROTOCOL_CHECKS`; raises the first :class:`PayloadError`."""
    expected = Expected(step, attempt, phase, fingerprint, max_samples)
    for check in PROTOCOL_CHECKS:
        upload = check(upload, expected)
    return upload
