"""``dadfl.server.progress`` — what the operator sees while the coordinator runs: progress, and optionally TensorBoard.

Steps are numbered from 0 everywhere: in ``metrics.jsonl``, the plots, the coordinator's
and the sites' logs ("step 5" is the sixth step); a count of steps done says "6/100".

On a terminal a live line (rich) shows the step, the steps done of the run's, the bar, the
time left and the train loss with the latest held-out metric, in 80 columns; while the
coordinator waits, it says how many sites of those it needs have joined. The whole record
(bytes and seconds per step too) goes to a log line above it at every evaluation step and
the last step. Elsewhere (a service, a container, a pipe) the same facts go out as plain
log lines, at most one per ``training.progress_every_s`` seconds plus every evaluation
step and the last step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dadfl.metrics import RANK_PREFIXES, human_bytes

log = logging.getLogger("dadfl.server")
console = Console(stderr=True)
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
STATUS_FILE = "status.json"  # what `dadfl status` reads: phase, step, sites joined of needed, the server's pid
# While training, status.json is rewritten at most this often (and at evaluation steps and the
# last step): a file replaced every step cost more than a small step's coordination per site.
STATUS_EVERY_S = 1.0


def write_status(run_dir: Path, **status) -> None:
    """``run_dir/status.json``, replaced atomically so a reader never sees half of it."""
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_name(STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps({**status, "pid": os.getpid(), "updated": time.time()}) + "\n")
    os.replace(tmp, path)


def setup_logging(verbose: bool) -> None:
    """Rich log lines above the live display on a terminal, plain lines otherwise."""
    level = logging.DEBUG if verbose else logging.INFO
    if console.is_terminal:
        logging.basicConfig(level=level, format="%(name)s %(message)s", handlers=[RichHandler(console=console, show_path=False)])
    else:
        logging.basicConfig(level=level, format=LOG_FORMAT)


def progress_text(record: dict, metric_name: str, latest_eval: dict) -> str:
    parts = [f"loss {record['train_loss']:.4f}"]
    for prefix, label in (("eval_", "sites' held-out"), ("test_", "coordinator test")):
        if f"{prefix}{metric_name}" in latest_eval:
            parts.append(f"{label} {metric_name} {latest_eval[prefix + metric_name]:.4f} (after step {latest_eval['step']})")
    parts.append(f"{human_bytes(record['bytes_up'])} up, {human_bytes(record['bytes_down'])} down, {record['seconds']:.3f} s/step")
    return "; ".join(parts)


def live_text(record: dict, metric_name: str, latest_eval: dict) -> str:
    """The live line's tail: the loss and the latest held-out metric, short enough that the
    whole line fits 80 columns."""
    text = f"loss {record['train_loss']:.4f}"
    for prefix in ("eval_", "test_"):
        if f"{prefix}{metric_name}" in latest_eval:
            return f"{text} {metric_name[:8]} {latest_eval[prefix + metric_name]:.4f}"
    return text


class OperatorView:
    """Fed one metrics record per step by the coordinator."""

    def __init__(self, steps: int, first_step: int, metric_name: str, every_s: float, run_dir: Path, tensorboard: bool):
        self.steps, self.metric_name, self.every_s, self.run_dir = steps, metric_name, every_s, run_dir
        self.next_step = first_step
        self.latest_eval: dict = {}
        self.last_wait: tuple[int, int] | None = None
        self.last_line = -math.inf  # the first step always logs
        self.last_status = -math.inf  # when status.json last said "training"
        self.bar: Progress | None = None
        if console.is_terminal:
            # step 12345 12346/100000 ━━━━━━━━━━ 0:00:00 loss 0.1234 accuracy 0.1234: 76 columns
            self.bar = Progress(
                TextColumn("{task.fields[label]}"), MofNCompleteColumn(), BarColumn(bar_width=10), TimeRemainingColumn(),
                TextColumn("{task.description}"), console=console, transient=False,
            )
            self.task = self.bar.add_task("", total=steps, completed=first_step, label=f"step {first_step}")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError(
                    f"training.tensorboard = true needs the tensorboard package: pip install 'dadfl[tensorboard]' ({exc})"
                ) from None
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.cumulative_bytes = 0

    def __enter__(self) -> "OperatorView":
        self.status("starting")
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def waiting(self, joined: int, needed: int) -> None:
        """The coordinator waits for sites: ``joined`` of the ``needed`` are connected (logged
        once per change, the live line says it until the step starts)."""
        if self.bar is not None:
            self.bar.update(self.task, description=f"waiting: {joined}/{needed} sites")
        if (joined, needed) != self.last_wait:
            self.last_wait = (joined, needed)
            self.last_status = -math.inf  # the step after a wait says "training" at once
            log.info("waiting for sites: %d of the %d needed are connected", joined, needed)
            self.status("waiting for sites", joined=joined, needed=needed)

    def status(self, phase: str, **facts) -> None:
        write_status(self.run_dir, phase=phase, step=self.next_step, steps=self.steps, **facts)

    def stopped(self, step: int) -> None:
        self.next_step = step
        self.status("stopped by the operator")

    def finished(self, steps: int) -> None:
        self.next_step = steps
        self.status("finished")

    def step(self, record: dict) -> None:
        step = record["step"]
        self.last_wait = None  # a later wait is logged again
        self.next_step = step + 1
        evaluated = any(key.startswith(("eval_", "test_")) for key in record)
        last = step + 1 == self.steps
        now = time.monotonic()
        if evaluated or last or now - self.last_status >= STATUS_EVERY_S:
            self.last_status = now
            self.status("training", sites=record.get("sites"))
        if evaluated:
            self.latest_eval = {k: v for k, v in record.items() if k.startswith(("eval_", "test_"))} | {"step": step}
        text = progress_text(record, self.metric_name, self.latest_eval)
        if self.bar is not None:
            live = live_text(record, self.metric_name, self.latest_eval)
            self.bar.update(self.task, completed=step + 1, description=live, label=f"step {step}")
        if evaluated or last or (self.bar is None and now - self.last_line >= self.every_s):
            self.last_line = now
            log.info("step %d (%d/%d done): %s", step, step + 1, self.steps, text)
        if self.writer is not None:
            self._tensorboard(record)

    def _tensorboard(self, record: dict) -> None:
        step = record["step"]
        self.cumulative_bytes += record["bytes_up"] + record["bytes_down"]
        scalars = {"train/loss": record["train_loss"], "bytes/cumulative": self.cumulative_bytes, "time/seconds_per_step": record["seconds"]}
        for key, value in record.items():
            if key.startswith(("eval_", "test_")) and isinstance(value, (int, float)):
                scalars[key.replace("_", "/", 1)] = value
            elif key.startswith(RANK_PREFIXES):  # rank90/<layer>/<site, sum or update>: one chart per layer
                scalars[key] = value
        for site, values in record.get("eval_by_site", {}).items():
            for name, value in values.items():
                scalars[f"eval_by_site/{site}/{name}"] = value
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.writer is not None:
            self.writer.close()
