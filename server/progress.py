"""What the operator sees while the coordinator runs: progress, and optionally TensorBoard.

On a terminal a live line (rich) shows step, train loss, the latest held-out metrics,
bytes and seconds per step, with log messages printed above it; elsewhere (a service,
a container, a pipe) the same facts go out as plain log lines, at most one per
``training.progress_every_s`` seconds plus every evaluation step and the last step.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dadfl.metrics import RANK_PREFIXES, human_bytes

log = logging.getLogger("dadfl.server")
console = Console(stderr=True)
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


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
            parts.append(f"{label} {metric_name} {latest_eval[prefix + metric_name]:.4f} (after step {latest_eval['step'] + 1})")
    parts.append(f"{human_bytes(record['bytes_up'])} up, {human_bytes(record['bytes_down'])} down, {record['seconds']:.3f} s/step")
    return "; ".join(parts)


class OperatorView:
    """Fed one metrics record per step by the coordinator."""

    def __init__(self, steps: int, first_step: int, metric_name: str, every_s: float, run_dir: Path, tensorboard: bool):
        self.steps, self.metric_name, self.every_s = steps, metric_name, every_s
        self.latest_eval: dict = {}
        self.last_line = -math.inf  # the first step always logs
        self.bar: Progress | None = None
        if console.is_terminal:
            self.bar = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(), TextColumn("{task.description}"),
                console=console, transient=False,
            )
            self.task = self.bar.add_task("waiting for sites", total=steps, completed=first_step)
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
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, record: dict) -> None:
        step = record["step"]
        evaluated = any(key.startswith(("eval_", "test_")) for key in record)
        if evaluated:
            self.latest_eval = {k: v for k, v in record.items() if k.startswith(("eval_", "test_"))} | {"step": step}
        text = progress_text(record, self.metric_name, self.latest_eval)
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, description=text)
        now = time.monotonic()
        if self.bar is None and (evaluated or step + 1 == self.steps or now - self.last_line >= self.every_s):
            self.last_line = now
            log.info("step %d/%d: %s", step + 1, self.steps, text)
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
