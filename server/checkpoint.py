"""Atomic checkpoints of the coordinator's replica, and resuming from them.

A checkpoint holds the model and optimizer state, the server strategy half's state at
the start of the next step, the next step to run, the run id, and the identity of the run (workload, strategy, optimizer) so a restart with a
different config is refused instead of silently mixing runs. Files are written to a
temporary name, flushed to disk and renamed (``os.replace``), so a crash leaves either
the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dadfl.metrics import read_metrics
from dadfl.replica import Replica
from dadfl.strategies.checks import all_finite

CHECKPOINT = "checkpoint.pt"
FINAL_MODEL = "model.pt"


@dataclass(frozen=True)
class Resumed:
    next_step: int
    run_id: str
    strategy_state: dict[str, torch.Tensor] | None  # None: a checkpoint written before states were kept


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path, replica: Replica, next_step: int, run_id: str, identity: dict, strategy_state: dict[str, torch.Tensor]
) -> None:
    state = {
        "next_step": next_step,
        "run_id": run_id,
        "identity": identity,
        "model": replica.model.state_dict(),
        "optimizer": replica.optimizer.state_dict(),
        "strategy_state": strategy_state,
    }
    atomic_save(state, run_dir / CHECKPOINT)


def save_final_model(run_dir: Path, replica: Replica) -> None:
    atomic_save(replica.model.state_dict(), run_dir / FINAL_MODEL)


def resume(run_dir: Path, replica: Replica, identity: dict) -> Resumed | None:
    """Load the run folder's checkpoint into ``replica``; None when there is none."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        return None
    state = torch.load(path, map_location=replica.device, weights_only=True)
    if state["identity"] != identity:
        differing = sorted(k for k in identity if identity[k] != state["identity"].get(k))
        raise ValueError(
            f"{path} belongs to a run with a different {', '.join(differing)}; "
            "use a new run_dir, or restore the config that wrote the checkpoint"
        )
    if not all(all_finite(tensor) for tensor in state["model"].values()):  # the coordinator never writes one
        raise ValueError(
            f"{path} holds non-finite weights, so the run cannot resume from it (no site is at fault); "
            "use a new run_dir, or restore a checkpoint written before the model went non-finite"
        )
    replica.model.load_state_dict(state["model"])
    replica.optimizer.load_state_dict(state["optimizer"])
    return Resumed(state["next_step"], state["run_id"], state.get("strategy_state"))


def trim_metrics(path: Path, next_step: int) -> None:
    """Drop records of steps after the checkpoint: they are run again after a restart."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if line.strip()]
    records = list(read_metrics(path))
    kept = [line for line, record in zip(kept, records) if record.get("step", -1) < next_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
