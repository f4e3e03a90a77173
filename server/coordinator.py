"""``dadfl.server.coordinator`` — the coordinator: one gRPC service that admits sites, carries their streams and runs the steps.

:class:`Coordinator` is the ``Coordinator`` gRPC service (``protos/dadfl/v1/coordinator.proto``)
and holds one run's state: the replica, the strategy's server half, the connected sites'
links, the step and the checkpoint step. Its behaviour lives in four parts, each in its
own module, that share that state:

- ``admission.py``: a stream's handshake (hello, token, certificate, quarantine, run
  config, ready) up to the site's link;
- ``streams.py``: the ``Join`` handler, reading a site's messages into its link, writing
  what the step loop queues, ending a stream with a reason;
- ``step_loop.py``: quorum, ``step_begin``, phases, commit, metrics, checkpoints, the
  operator's stop and the end of the run;
- ``uploads.py``: one phase's uploads collected, checked, aggregated, refused.

Contract: every replica (the server's and every site's) applies the same messages and ends
each step bit-identical (weights fingerprint); a step is committed only when every
participant reported it done, otherwise no replica keeps it. A coordinator killed and
restarted from its checkpoint, or a site killed and rejoining, ends with exactly the
model of an uninterrupted run (with the same participants). Every value a site sends is
checked before it is used, and what a site can make the coordinator hold is bounded
(``links.py``). Joins, refusals, quarantines and the run's start, end or stop go to
``run_dir/audit.jsonl`` (``dadfl/audit.py``); one record a step to
``run_dir/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
import weakref
from pathlib import Path

from dadfl.audit import FILE as AUDIT_FILE
from dadfl.audit import AuditLog
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.codec import codec_id
from dadfl.strategies import weights_fingerprint

from . import checkpoint
from .admission import Admission
from .config import ServerConfig
from .enrol import Enrolment
from .links import Encoded, SiteLink
from .preflight import build_replica
from dadfl.privacy.coordinator import ServerPrivacy, split_state
from .progress import OperatorView
from .quarantine import Quarantine
from dadfl.trust.screening import Screening
from .step_loop import ModelNotFinite, RunStopped, StepLoop, StoppedByOperator
from .streams import SiteStreams
from .uploads import PhaseUploads

__all__ = ["Coordinator", "ModelNotFinite", "RunStopped", "StoppedByOperator"]

log = logging.getLogger("dadfl.server")


def strategy_label(name: str, options: dict, label: str = "") -> str:
    """The strategy's name in metrics, as the in-process simulation writes it."""
    if label:
        return label
    suffix = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{name}({suffix})" if suffix else name


class Coordinator(Admission, SiteStreams, PhaseUploads, StepLoop, cpb_grpc.CoordinatorServicer):
    """One run's coordinator: the state the four parts share, set up (or resumed from the
    checkpoint in ``run_dir``) before the server listens."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.replica = build_replica(config)
        workload, self.strategy = self.replica.workload, self.replica.strategy
        self.eval_metrics = ("loss", workload.metric_name)
        self.label = strategy_label(config.strategy.name, config.strategy.options, config.strategy.label)
        self.layout = self.replica.layout
        self.codec = codec_id(config.wire.codec)
        federation = config.federation
        # Under [dp] the robust weights are off: they depend on every site's data, so one record
        # could move a whole site's weight and the noise is calibrated on per-sample clipping only.
        private = config.dp is not None
        self.screening = Screening(
            self.replica, federation.max_influence_ratio, federation.max_update_norm, self.codec,
            None if private else federation.clip_ratio, federation.agreement and not private, federation.agreement_margin,
            momentum=federation.agreement_momentum, full_count_share=federation.full_count_share,
        )
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.quarantine = Quarantine(self.run_dir, config.federation.quarantine_after)
        self.audit_log = AuditLog(self.run_dir / AUDIT_FILE)  # joins, refusals, quarantines, the operator's stop
        self.refusals_audited = (0.0, 0, 0)  # (minute started, refusals recorded in it, refusals not recorded)
        self.step_refusals: set[str] = set()  # sites refused during the step under way
        self.identity = {
            "workload": [config.workload.spec, config.workload.options],
            "strategy": [config.strategy.name, config.strategy.options],
            "optimizer": config.optimizer.model_dump(),
            # only when set: checkpoints written before precision existed stay resumable
            **({"precision": config.training.precision} if config.training.precision != "fp32" else {}),
        }
        self.privacy = None  # [dp]: the noisy dense downlink replaces the strategy's message (privacy.py)
        if config.dp is not None:
            self.identity["dp"] = config.dp.model_dump()
            self.privacy = ServerPrivacy(
                config.dp, config.training.batch_size, config.training.steps, self.replica.model, workload.example(), self.run_dir,
            )
        resumed = checkpoint.resume(self.run_dir, self.replica, self.identity)
        if resumed and self.privacy is not None:
            strategy_state, privacy_state = split_state(resumed.strategy_state or {})
            self.privacy.load_state_dict(privacy_state)
            resumed = dataclasses.replace(resumed, strategy_state=strategy_state if resumed.strategy_state is not None else None)
        self.step = resumed.next_step if resumed else 0
        self.checkpoint_step = self.step  # the step a restart would replay from
        self.run_id = resumed.run_id if resumed else uuid.uuid4().hex[:12]
        if resumed:
            self.screening.standing, self.screening.recent_norms = resumed.standing, resumed.recent_norms
            self.screening.peer_standing, self.screening.momenta = resumed.peer_standing, resumed.momenta
            log.info("resuming run %s at step %d from %s", self.run_id, self.step, self.run_dir / checkpoint.CHECKPOINT)
        checkpoint.trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.fingerprint = weights_fingerprint(self.replica.model)
        self.links: dict[str, SiteLink] = {}
        self.arrivals: asyncio.Queue = asyncio.Queue()  # links with a new event, shared by all (see links.py)
        self.changed = asyncio.Event()
        self.stop_requested = False  # request_stop(): the loop stops before the next step or attempt
        self.finished = False
        self.known_sites: set[str] = set()  # every site that took part in this server's run
        self.told_finished: set[str] = set()
        self.handshakes = 0  # streams between hello and admission (or the finished answer)
        self.enrolment = Enrolment(Path(config.listen.tokens))
        self.server_half = self.strategy.server(self.layout, self.replica.model)
        self.reset_reason = ""  # set when the server half could not be restored: reset everywhere
        if resumed and resumed.strategy_state is None:
            self.reset_reason = "the checkpoint holds no strategy state"
        elif resumed:
            try:
                self.server_half.load_state_dict(resumed.strategy_state)
            except (KeyError, ValueError) as exc:
                self.reset_reason = f"the checkpoint's strategy state does not load ({exc})"
        self.half_at_step_start = self.server_half.state_dict()  # restored after an aborted attempt
        self.went_ahead: set[SiteLink] = set()  # participants that began the next step by themselves
        self._state_encoded: tuple[tuple[int, str], list[weakref.ref[Encoded]]] | None = None  # _state_messages
        self._block_hashes: tuple[tuple[int, str], list[int]] | None = None  # _resync
        self.going_on: set[SiteLink] = set()  # those of them whose uploads the next step takes
        self.view = OperatorView(  # made here: a missing TensorBoard stops the server before it listens
            config.training.steps, self.step, workload.metric_name, config.training.progress_every_s,
            self.run_dir, config.training.tensorboard,
        )
