"""Protocol checks on every upload before the strategy's own checks see it.

An upload must answer the step, attempt and phase the server is running, be computed
from the server's current weights (the model version, by fingerprint), claim a sample
count within the configured batch size (per local step), and report a non-negative loss (a
non-finite loss, or tensor, is judged with the phase's other uploads: ``screening.model_fault``). What
its tensors may be is the strategy's to say (``Strategy.check_uploads``). Each failure
is a :class:`PayloadError` whose text says what was wrong; the coordinator drops that
site from the step and keeps running.
"""

from __future__ import annotations

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import Assembled
from dadfl.sanitize import printable


class PayloadError(ValueError):
    """An upload the coordinator refuses; the message says what was wrong."""


def check_protocol(upload: Assembled, step: int, attempt: int, phase: int, fingerprint: str, max_samples: int) -> None:
    header, payload = upload.header, upload.payload
    if header.kind != pb.PHASE:
        raise PayloadError("expected a phase payload, got a state payload")
    if (header.step, header.attempt) != (step, attempt):
        raise PayloadError(f"payload for step {header.step} (attempt {header.attempt}) while the server runs step {step} (attempt {attempt})")
    if header.phase != phase:
        raise PayloadError(f"payload for phase {header.phase} while the server waits for phase {phase}")
    if header.base_fingerprint != fingerprint:
        raise PayloadError(
            f"payload computed from model version {printable(header.base_fingerprint[:12]) if header.base_fingerprint else '(none)'} but the current "
            f"model is {fingerprint[:12]}: the site's weights are stale"
        )
    if not 1 <= payload.num_samples <= max_samples:
        raise PayloadError(f"num_samples={payload.num_samples} is outside 1..{max_samples} (the configured batch size, per local step)")
    if header.loss_sum < 0:  # NaN passes: whose fault it is depends on the others (screening.model_fault)
        raise PayloadError(f"loss_sum={header.loss_sum!r} must be >= 0")
    if not payload.tensors:
        raise PayloadError("payload has no tensors")
