"""``dadfl.flower.serverapp`` — the ServerApp's loop and the entry points that run it.

A thin runtime: the strategy code does all the math, as in the in-process simulation
(``strategies.step.exchange`` is the loop mirrored here). Per step the ServerApp sends every node
``train.step``, aggregates the phase's payloads in node order (reproducible sums), sends the
message back as ``train.phase`` until the last phase, applies the same messages to its own
replica and checks every node's fingerprint against its own.

**Resync.** A node that answers ``need_state`` or ``lost`` restarts the step: every node gets the
server's full state and rebuilds its site half, and the server rebuilds its server half.
Exactness is unaffected; strategy state (error feedback, warm starts) restarts from scratch, as
in the gRPC runtime. There is no dropout tolerance: a node that fails, refuses or does not answer
stops the run with a :class:`FlowerRunError` naming it (the gRPC runtime, ``dadfl server``,
tolerates dropouts).

**Trust.** A reply is read bounded first (``dadfl.flower.records.read_reply``), then passes the
gRPC coordinator's own checks (``dadfl.trust.protocol``, ``dadfl.trust.screening``) under
:class:`~dadfl.flower.settings.ServerBounds`. Non-finite values the model produced stop the run
naming no node (``dadfl.trust.screening.model_fault``). What Flower holds before the ServerApp
sees a reply is Flower's to bound.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from dadfl.metrics import MetricsWriter, is_eval_step, run_summary, write_summary
from dadfl.model_identity import identity_text
from dadfl.protos.state import state_payload
from dadfl.records import StepRecord
from dadfl.report import write_plots
from dadfl.replica import Decoded, Replica, resolve_device
from dadfl.sanitize import one_line
from dadfl.simulation import Progress, SimulationConfig, StrategySpec, run_directory
from dadfl.strategies import Payload, make_strategy, weights_fingerprint
from dadfl.trust.protocol import PayloadError, check_protocol
from dadfl.trust.screening import WEIGHTS_NOT_FINITE, Screening, model_fault, model_fault_reason, nonfinite_reasons, weights_finite

from .node import make_client_app
from .records import DONE, HEADER, LOST, NEED_STATE, PAYLOAD, PHASE_MESSAGE, REFUSED, Refused, Reply, STATE, STEP_MESSAGE, payload_content, read_reply, record_from_tensors
from .settings import RunSettings, ServerBounds, settings_from_run_config, workload_for

log = logging.getLogger("dadfl.flower")


NODE_WAIT_S = 300.0  # how long the ServerApp waits for enough SuperNodes to connect
REPLY_TIMEOUT_S = 600.0  # a fresh flwr-clientapp process imports torch and loads the workload
MAX_ATTEMPTS_PER_STEP = 3


class FlowerRunError(RuntimeError):
    """A node failed, did not answer, or its state could not be repaired; the message says which."""


@dataclass
class StepResult:
    messages: list[Payload]
    samples: int
    loss_sum: float
    bytes_up: int
    bytes_down: int
    phase_seconds: list[float]
    fingerprints: dict[int, str]  # by node id, after the step
    update: Decoded  # decoded from the messages as the nodes decode them (again, a parameter at a time, when applied), checked


class FlowerCoordinator:
    """The ServerApp's loop: the coordinator replica, the server half, one step at a time."""

    def __init__(self, settings: RunSettings, grid: Grid, metrics: MetricsWriter, progress: Progress | None = None,
                 bounds: ServerBounds = ServerBounds()):
        self.settings, self.grid, self.metrics, self.progress, self.bounds = settings, grid, metrics, progress, bounds
        self.config, self.spec = settings.config, settings.spec
        self.settings_json = settings.to_json()
        torch.set_num_threads(self.config.threads)
        self.strategy = make_strategy(self.spec.name, **self.spec.options)
        device = resolve_device(self.config.device)
        self.replica = Replica(workload_for(self.config), self.strategy, self.config.optimizer, device, probe=True,
                               precision=self.config.precision)
        # Sent only where nodes build their replica afresh (step 0, a full state): JSON of 0.6 KB
        # (digits MLP) to 6.6 KB (char transformer), too much for every step.
        self.model_identity = identity_text(self.replica.layout.lines(), self.replica.model_probe)
        self.server_half = self.strategy.server(self.replica.layout, self.replica.model)
        self.screening = Screening(
            self.replica, bounds.max_influence_ratio, bounds.max_update_norm, clip_ratio=bounds.clip_ratio, agreement=bounds.agreement,
            agreement_margin=bounds.agreement_margin, momentum=bounds.agreement_momentum, full_count_share=bounds.full_count_share,
        )
        self.fingerprint = weights_fingerprint(self.replica.model)
        self.nodes: list[int] = []

    def wait_for_nodes(self) -> list[int]:
        """The first ``sites`` node ids in sorted order; a node's position is its partition index."""
        deadline = time.monotonic() + NODE_WAIT_S
        while len(connected := sorted(self.grid.get_node_ids())) < self.config.sites:
            if time.monotonic() > deadline:
                raise FlowerRunError(
                    f"only {len(connected)} of the {self.config.sites} SuperNodes this run needs (sites) connected "
                    f"within {NODE_WAIT_S:g} s; start more SuperNodes or lower sites"
                )
            time.sleep(0.5)
        return connected[: self.config.sites]

    def run(self) -> dict[str, Any]:
        """Train for ``config.steps`` steps; write one record per step; return a summary."""
        self.nodes = self.wait_for_nodes()
        log.info("dadfl over Flower: %s on nodes %s", self.spec.display, self.nodes)
        records: list[dict[str, Any]] = []
        for step in range(self.config.steps):
            started = time.perf_counter()
            result, attempt = None, 0
            while result is None:
                if attempt == MAX_ATTEMPTS_PER_STEP:
                    raise FlowerRunError(f"step {step}: nodes kept losing their state after {attempt} attempts")
                result = self.run_step(step, attempt)
                attempt += 1
            self.fingerprint = self.replica.apply_update(result.update)
            if not weights_finite(self.replica.model):
                raise FlowerRunError(f"step {step}: {WEIGHTS_NOT_FINITE}")
            elapsed = time.perf_counter() - started
            mismatched = [str(node) for node, fp in result.fingerprints.items() if fp != self.fingerprint]
            if mismatched:
                log.warning("step %d: nodes %s ended with other weights; they resync next step", step, ", ".join(mismatched))
            site_ids = [str(node) for node in self.nodes]
            record = StepRecord(
                strategy=self.spec.display,
                step=step,
                sites=len(self.nodes),
                samples=result.samples,
                train_loss=result.loss_sum / result.samples,
                bytes_up=result.bytes_up,
                bytes_down=result.bytes_down,
                seconds=elapsed,
                fingerprint=self.fingerprint,
                phase_seconds=result.phase_seconds,
                site_ids=site_ids,
                attempt=attempt - 1,
                fingerprint_mismatches=mismatched,
                diagnostics={**self.screening.commit(step, site_ids), **self.strategy.describe(self.replica.layout, result.messages)},
            )
            if is_eval_step(step, self.config.eval_every, self.config.steps):
                record.evaluation.update({f"test_{k}": v for k, v in self.replica.evaluate().items()})
            row = record.to_json()
            self.metrics.write(row)
            records.append(row)
            if self.progress:
                self.progress(step)
        return run_summary(records, self.spec.display, self.replica.workload.metric_name)

    def run_step(self, step: int, attempt: int) -> StepResult | None:
        """All phases of one step, as ``exchange`` runs them; None when a node lost its state.

        The server has then applied nothing; the restart (a later ``attempt``) sends every
        node the full state, which also undoes what nodes that finished the step had applied.
        """
        resync = attempt > 0
        if resync:
            self.server_half = self.strategy.server(self.replica.layout, self.replica.model)
        phase_started = time.perf_counter()
        replies = self.round(step, attempt, 0, STEP_MESSAGE, self.step_content(step, attempt, resync))
        if self.needs_restart(step, replies, state_sent=resync):
            return None
        messages: list[Payload] = []
        payloads = self.uploads(step, attempt, 0, replies, messages)
        samples = sum(p.num_samples for p in payloads)
        loss_sum = sum(reply.fields["loss_sum"] for reply in replies)
        phase_seconds, bytes_up, bytes_down = [], 0, 0
        while True:
            bytes_up += sum(p.nbytes() for p in payloads)
            message, sent, update = self.aggregate(step, payloads, messages)
            messages.append(sent)  # what every node decodes
            bytes_down += message.nbytes() * len(self.nodes)
            content = payload_content(sent, attempt=attempt)  # the bytes every node decodes, as the update was taken from them
            replies = self.round(step, attempt, message.phase + 1, PHASE_MESSAGE, lambda _: content)
            phase_seconds.append(time.perf_counter() - phase_started)
            phase_started = time.perf_counter()
            if self.needs_restart(step, replies, state_sent=False):
                return None
            statuses = {reply.status for reply in replies}
            if statuses == {DONE}:
                fingerprints = {node: reply.fields["fingerprint"] for node, reply in zip(self.nodes, replies)}
                return StepResult(messages, samples, loss_sum, bytes_up, bytes_down, phase_seconds, fingerprints, update)
            if statuses != {PAYLOAD}:
                raise FlowerRunError(f"step {step}: nodes disagree on the number of phases ({sorted(statuses)})")
            payloads = self.uploads(step, attempt, message.phase + 1, replies, messages)

    def uploads(self, step: int, attempt: int, phase: int, replies: Sequence[Reply], messages: list[Payload]) -> list[Payload]:
        """The phase's payloads, each past the protocol checks (``dadfl.trust.protocol.check_protocol``),
        then all past the strategy's rules and the influence bound (``dadfl.trust.screening``)."""
        max_samples = self.screening.max_samples(self.config.batch_size, step)
        for node, reply in zip(self.nodes, replies):
            if reply.status != PAYLOAD:
                self.refuse(node, step, phase, f"it replied {reply.status!r} where its phase {phase} payload was due")
            try:
                check_protocol(reply.upload(), step, attempt, phase, self.fingerprint, max_samples)
            except PayloadError as exc:
                self.refuse(node, step, phase, str(exc))
        payloads = [reply.payload.to(self.replica.device) for reply in replies]
        nonfinite = nonfinite_reasons([reply.fields["loss_sum"] for reply in replies], payloads)
        if model_fault(len(nonfinite), len(replies)):
            raise FlowerRunError(model_fault_reason(step, phase, list(nonfinite.values()), len(replies), weights_finite(self.replica.model)))
        refused = {**nonfinite, **self.screening.refusals(step, phase, payloads, messages)}
        for index, reason in sorted(refused.items()):
            self.refuse(self.nodes[index], step, phase, reason)
        return payloads

    def aggregate(self, step: int, payloads: list[Payload], messages: list[Payload]) -> tuple[Payload, Payload, Decoded]:
        """The phase's message, as nodes receive it and the update it decodes to after this
        phase (``Screening.message``); a message that would fail at a node stops the run,
        naming the nodes whose uploads break it."""
        phase, start = payloads[0].phase, self.server_half.state_dict()
        try:
            return self.screening.message(self.server_half, payloads, messages, sites=[str(node) for node in self.nodes])
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        breaking = self.screening.breaking(start, payloads, messages)
        if not breaking or len(breaking) == len(payloads):
            raise FlowerRunError(f"step {step} phase {phase}: the {self.strategy.name} server half failed: {one_line(failure)}")
        self.refuse([self.nodes[index] for index in breaking], step, phase, f"the upload breaks the aggregated message ({one_line(failure)})")

    def refuse(self, nodes: int | list[int], step: int, phase: int, reason: str) -> NoReturn:
        """Stop the run for a node's bad reply: over Flower every node must answer every step.
        ``reason`` is the checks' own text (names a node sent are quoted by them)."""
        nodes = [nodes] if isinstance(nodes, int) else nodes
        who = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(map(str, nodes))}"
        raise FlowerRunError(f"step {step} phase {phase}: {who} refused: {reason}")

    def step_content(self, step: int, attempt: int, with_state: bool) -> Callable[[int], RecordDict]:
        """The ``train.step`` content for the node at each position. With the full state (a
        resync) every node rebuilds its replica and site half: strategy state restarts. The
        model identity goes where a node builds its replica afresh: step 0 and a full state."""
        state = record_from_tensors(state_payload(self.replica, step).tensors) if with_state else None
        layout = self.replica.layout.fingerprint()
        model = self.model_identity if with_state or step == 0 else ""

        def content(position: int) -> RecordDict:
            header = ConfigRecord(
                {
                    "step": step,
                    "attempt": attempt,
                    "phase": 0,
                    "num_samples": 0,
                    "settings": self.settings_json,
                    "partition_index": position,
                    "fingerprint": self.fingerprint,
                    "layout": layout,
                    "model": model,
                }
            )
            records: dict[str, Any] = {HEADER: header}
            if state is not None:
                records[STATE] = state
            return RecordDict(records)

        return content

    def needs_restart(self, step: int, replies: Sequence[Reply], state_sent: bool) -> bool:
        """Whether a node lost its state (the step restarts); an error if the state it was
        just sent did not fix it."""
        lost = [(node, reply.status) for node, reply in zip(self.nodes, replies) if reply.status in (NEED_STATE, LOST)]
        if not lost:
            return False
        if state_sent:
            raise FlowerRunError(
                f"step {step}: nodes {', '.join(str(n) for n, _ in lost)} still differ after loading the server's state; "
                "sites must compute on the same kind of device as the server for replicas to stay bit-identical"
            )
        log.warning("step %d: %s; sending every node the full state", step, ", ".join(f"node {n} {s}" for n, s in lost))
        return True

    def round(
        self, step: int, attempt: int, phase: int, message_type: str, content_for: Callable[[int], RecordDict]
    ) -> list[Reply]:
        """Send each node (by position) its message, wait for every reply; the replies, read
        and bounded (:func:`read_reply`), in node order. ``phase``: of the uploads they carry."""
        outgoing = [
            Message(content_for(position), node, message_type, group_id=str(step))
            for position, node in enumerate(self.nodes)
        ]
        replies = {reply.metadata.src_node_id: reply for reply in self.grid.send_and_receive(outgoing, timeout=REPLY_TIMEOUT_S)}
        missing = [node for node in self.nodes if node not in replies]
        if missing:
            raise FlowerRunError(
                f"step {step} phase {phase}: no reply from node(s) {', '.join(map(str, missing))} within {REPLY_TIMEOUT_S:g} s; "
                "every node must answer every step over Flower (the gRPC runtime tolerates dropouts)"
            )
        for node in self.nodes:
            if replies[node].has_error():
                raise FlowerRunError(f"step {step} phase {phase}: node {node} failed: {one_line(str(replies[node].error.reason))}")
        upload_dtypes = functools.cache(lambda: self.screening.upload_dtypes(step, phase))
        checked = []
        for node in self.nodes:
            try:
                reply = read_reply(replies[node].content, upload_dtypes, self.bounds.max_payload_bytes)
            except Refused as exc:
                self.refuse(node, step, phase, str(exc))
            if reply.status == REFUSED:
                reason = one_line(reply.fields["reason"])
                raise FlowerRunError(f"step {step} phase {phase}: node {node} refuses the server's message: {reason}")
            checked.append(reply)
        return checked


@dataclass
class FlowerApps:
    """A ServerApp/ClientApp pair for one strategy; ``summary`` is set when the run ends."""

    server_app: ServerApp
    client_app: ClientApp
    summary: dict[str, Any] | None = None


def make_flower_apps(
    config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress: Progress | None = None
) -> FlowerApps:
    """Apps that train ``spec`` with ``config`` and write one record per step to ``metrics``."""
    make_strategy(spec.name, **spec.options)  # unknown names or options fail here, not in a node
    settings = RunSettings(config, spec)
    apps = FlowerApps(ServerApp(), make_client_app())

    @apps.server_app.main()
    def main(grid: Grid, context: Context) -> None:
        apps.summary = FlowerCoordinator(settings, grid, metrics, progress).run()

    return apps


def make_server_app() -> ServerApp:
    """The ServerApp for ``flwr run``: settings from the run config (:func:`settings_from_run_config`);
    writes ``config.json``, ``metrics.jsonl``, ``summary.json`` and plots to a new run directory."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings, out, bounds = settings_from_run_config(dict(context.run_config))
        run_dir = run_directory(out, f"flower-{context.run_id}")
        (run_dir / "config.json").write_text(json.dumps(settings.config.model_dump(mode="json"), indent=2))
        with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
            summary = FlowerCoordinator(settings, grid, metrics, bounds=bounds).run()
        write_summary(run_dir / "summary.json", [summary])
        write_plots(run_dir)
        log.info("dadfl over Flower: %s -> %s", summary, run_dir)

    return app


server_app = make_server_app()


def simulate_flower(
    config: SimulationConfig,
    spec: StrategySpec,
    metrics: MetricsWriter,
    progress: Progress | None = None,
    actors: int | None = None,
) -> dict[str, Any]:
    """Train ``spec`` with Flower's simulation engine (Ray) and ``config.sites`` supernodes.

    The counterpart of :func:`dadfl.simulation.simulate`: the same records into ``metrics``,
    the same summary. ``actors`` Ray workers run the ClientApp (default: one per site, at
    most one per CPU core).
    """
    from flwr.simulation import run_simulation

    actors = actors or max(1, min(config.sites, os.cpu_count() or 1))
    # Ray hides GPUs from actors that request none; replicas must compute on one kind of device.
    gpu_share = 1.0 / actors if resolve_device(config.device).type == "cuda" else 0.0
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": gpu_share},
        "init_args": {"num_cpus": actors, "num_gpus": 1 if gpu_share else 0},
    }
    apps = make_flower_apps(config, spec, metrics, progress)
    run_simulation(apps.server_app, apps.client_app, num_supernodes=config.sites, backend_config=backend_config)
    if apps.summary is None:
        raise FlowerRunError("the Flower simulation ended before the ServerApp finished; see the log above")
    return apps.summary


def run_flower_simulation(
    config: SimulationConfig,
    spec: StrategySpec,
    run_dir: str | Path,
    progress: Progress | None = None,
    actors: int | None = None,
) -> dict[str, Any]:
    """:func:`simulate_flower` appending its records to ``run_dir/metrics.jsonl``."""
    with MetricsWriter(Path(run_dir) / "metrics.jsonl") as metrics:
        return simulate_flower(config, spec, metrics, progress, actors)
