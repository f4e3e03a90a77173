"""``dadfl.records`` — typed records the runtimes fill and the tools read: one step of a run (:class:`StepRecord`)."""

from .step import StepRecord

__all__ = ["StepRecord"]
