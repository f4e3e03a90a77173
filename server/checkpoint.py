"""``dadfl.server.checkpoint`` — atomic checkpoints of the coordinator's replica, and resuming from them.

A checkpoint holds the model and optimizer state, the server strategy half's state at
the start of the next step, the next step to run, the run id, the robust rule's standings of
each site (its own and its peers'), its recent update norms (the clip's history) and its momentum, and the identity of the run
(workload, strategy, optimizer) so a restart with a different config is refused instead of
silently mixing runs. Files are written to a temporary name, flushed to disk and renamed
(``os.replace``), so a crash leaves either the old or the new checkpoint, never a torn one.

The checkpoint is a state file (``protos/state_file.py``): its tensors are written from
the replica's own memory and read back into it one chunk at a time, so a checkpoint of a
100M-parameter model with Adam (1.2 GB) costs no second copy of the state in memory
(``torch.load`` would hold one). Its keys are the state payload's (``model/``, ``optim/``:
``protos/state.py``), ``strategy/<name>`` and the sites' momenta (``strategy/robust-momentum/<k>``,
the k-th of the meta's ``momenta``: site, phase, parameter); the next step, run id and identity are its
JSON meta. The final model stays a ``torch.save`` of the state dict (``torch.save``
writes a tensor's storage from its memory), for anyone's ``torch.load``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dadfl.metrics import read_metrics
from dadfl.protos.state import fill_state, state_payload
from dadfl.protos.state_file import verify, write_state
from dadfl.replica import Replica
from dadfl.sanitize import one_line
from dadfl.strategies.checks import all_finite
from dadfl.strategies.robust import CLIP_HISTORY_STEPS

CHECKPOINT = "checkpoint.pt"
FINAL_MODEL = "model.pt"
STRATEGY_PREFIX = "strategy/"
MOMENTUM_PREFIX = "robust-momentum/"  # under STRATEGY_PREFIX: the robust rule's momenta, not the strategy's state
MAGIC = b"dadflck1"  # a checkpoint, version 1 of the state file layout


@dataclass(frozen=True)
class Resumed:
    next_step: int
    run_id: str
    strategy_state: dict[str, torch.Tensor] | None  # None: a checkpoint written before states were kept
    standing: dict[str, float]  # the robust rule's standing by site id (``Screening.standing``)
    peer_standing: dict[str, float]  # and its peers' standing (``Screening.peer_standing``)
    recent_norms: dict[str, dict[int, list[float]]]  # the clip's history by site id and phase (``Screening.recent_norms``)
    momenta: dict[str, dict[int, dict[str, torch.Tensor]]]  # by site id, phase and parameter (``Screening.momenta``)


def atomic_write(path: Path, write) -> None:
    """``write(file)`` into a temporary file, flushed to disk, then renamed to ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path, replica: Replica, next_step: int, run_id: str, identity: dict, strategy_state: dict[str, torch.Tensor],
    standing: dict[str, float], recent_norms: dict[str, dict[int, list[float]]] | None = None, peer_standing: dict[str, float] | None = None,
    momenta: dict[str, dict[int, dict[str, torch.Tensor]]] | None = None,
) -> None:
    state = state_payload(replica, next_step)
    state.tensors.update({STRATEGY_PREFIX + key: tensor.detach() for key, tensor in strategy_state.items()})
    places = [(site, phase, name) for site, phases in (momenta or {}).items() for phase, held in phases.items() for name in held]
    state.tensors.update({
        f"{STRATEGY_PREFIX}{MOMENTUM_PREFIX}{k}": momenta[site][phase][name] for k, (site, phase, name) in enumerate(places)
    })
    meta = json.dumps(
        {
            "next_step": next_step, "run_id": run_id, "identity": identity, "standing": standing, "recent_norms": recent_norms or {},
            "peer_standing": peer_standing or {}, "momenta": places,
        }
    ).encode()  # floats as repr: they read back to the bit
    atomic_write(run_dir / CHECKPOINT, lambda file: write_state(file, state, meta, MAGIC))


def save_final_model(run_dir: Path, replica: Replica) -> None:
    atomic_write(run_dir / FINAL_MODEL, lambda file: torch.save(replica.model.state_dict(), file))


def resume(run_dir: Path, replica: Replica, identity: dict) -> Resumed | None:
    """Load the run folder's checkpoint into ``replica``; None when there is none."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        return None
    with path.open("rb") as file:
        try:
            meta, _ = verify(file, MAGIC)
            saved = json.loads(meta)
        except ValueError as exc:
            raise ValueError(
                f"{path} is not a readable checkpoint ({one_line(str(exc), 120)}); use a new run_dir, or restore a good copy of it"
            ) from None
        if saved["identity"] != identity:
            differing = sorted(k for k in identity if identity[k] != saved["identity"].get(k))
            raise ValueError(
                f"{path} belongs to a run with a different {', '.join(differing)}; "
                "use a new run_dir, or restore the config that wrote the checkpoint"
            )
        extra = fill_state(replica, file, MAGIC, STRATEGY_PREFIX)
    saved_momenta = {key[len(MOMENTUM_PREFIX):]: extra.pop(key) for key in list(extra) if key.startswith(MOMENTUM_PREFIX)}
    momenta = checked_momenta(saved.get("momenta", []), saved_momenta, replica, path)
    if not all(all_finite(tensor) for tensor in replica.model.state_dict().values()):  # the coordinator never writes one
        raise ValueError(
            f"{path} holds non-finite weights, so the run cannot resume from it (no site is at fault); "
            "use a new run_dir, or restore a checkpoint written before the model went non-finite"
        )
    return Resumed(
        saved["next_step"], saved["run_id"], extra, checked_standing(saved.get("standing", {}), path),
        checked_standing(saved.get("peer_standing", {}), path), checked_recent_norms(saved.get("recent_norms", {}), path), momenta,
    )


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def checked_standing(saved: object, path: Path) -> dict[str, float]:
    """The robust rule's standing as a checkpoint holds it: site ids to finite numbers."""
    if not (isinstance(saved, dict) and all(isinstance(k, str) and _finite_number(v) for k, v in saved.items())):
        raise ValueError(f"{path} holds a malformed robust standing; use a new run_dir, or restore a good copy of it")
    return {k: float(v) for k, v in saved.items()}


def checked_recent_norms(saved: object, path: Path) -> dict[str, dict[int, list[float]]]:
    """The clip's history as a checkpoint holds it: site ids to phases to at most
    ``CLIP_HISTORY_STEPS`` finite, non-negative norms."""
    def norms_ok(norms: object) -> bool:
        return isinstance(norms, list) and len(norms) <= CLIP_HISTORY_STEPS and all(_finite_number(v) and v >= 0 for v in norms)

    if not (isinstance(saved, dict) and all(
        isinstance(site, str) and isinstance(phases, dict)
        and all(isinstance(phase, str) and phase.isascii() and phase.isdigit() and len(phase) <= 3 and norms_ok(norms) for phase, norms in phases.items())
        for site, phases in saved.items()
    )):
        raise ValueError(f"{path} holds a malformed robust clip history; use a new run_dir, or restore a good copy of it")
    return {site: {int(phase): [float(v) for v in norms] for phase, norms in phases.items()} for site, phases in saved.items()}


def checked_momenta(
    places: object, tensors: dict[str, torch.Tensor], replica: Replica, path: Path
) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """The sites' momenta as a checkpoint holds them: the meta names (site id, phase, name) for
    each tensor, in order; each tensor flat, float32, finite, one size per name, at most a
    model's elements (a name is a parameter's or a strategy's factored matrix's)."""
    most = sum(param.numel() for param in replica.model.parameters())

    def place_ok(place: object) -> bool:
        return (
            isinstance(place, list) and len(place) == 3 and isinstance(place[0], str) and isinstance(place[1], int)
            and not isinstance(place[1], bool) and 0 <= place[1] < 1000 and isinstance(place[2], str) and len(place[2]) <= 1000
        )

    if not (isinstance(places, list) and all(place_ok(place) for place in places) and sorted(tensors) == sorted(map(str, range(len(places))))):
        raise ValueError(f"{path} holds a malformed robust momentum; use a new run_dir, or restore a good copy of it")
    momenta: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    sizes: dict[str, int] = {}
    for k, (site, phase, name) in enumerate(places):
        tensor = tensors[str(k)].cpu()
        size = sizes.setdefault(name, tensor.numel())
        if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.numel() != size or size > most or not all_finite(tensor):
            raise ValueError(f"{path} holds a malformed robust momentum; use a new run_dir, or restore a good copy of it")
        momenta.setdefault(site, {}).setdefault(phase, {})[name] = tensor
    return momenta


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
