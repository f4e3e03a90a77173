"""One rank of the DDP ``powerSGD_hook`` run that ``bench.peers`` compares against.

``python -m bench.ddp_worker RANK PORT FOLDER SPEC_JSON``: builds the workload, the
partition and the batch stream exactly as site RANK of the in-process simulation does,
trains with DistributedDataParallel + ``powerSGD_hook`` over gloo, and writes
``FOLDER/ddp_r<r>_rank<RANK>.json``: the local mean loss and the bytes handed to
``all_reduce`` per step, and (rank 0) the held-out metric at the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dadfl.replica import Replica
from dadfl.simulation import SimulationConfig
from dadfl.strategies import make_strategy
from dadfl.workloads import load_workload, partition, site_batches


def count_allreduce_bytes() -> list[int]:
    """Wrap ``dist.all_reduce`` (the hook calls it through the module) to add up input bytes."""
    counter = [0]
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return counter


def main(rank: int, port: str, folder: Path, spec: dict) -> None:
    torch.set_num_threads(1)
    config = SimulationConfig(**spec["config"])
    workload = load_workload(config.workload, **config.workload_options)
    indices = partition(
        config.sites, len(workload.train), config.partition, labels=workload.labels, alpha=config.alpha, seed=config.seed
    )
    batches = site_batches(workload.train, indices[rank], config.batch_size, seed=config.seed + rank)
    model = workload.build_model()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.sites)
    counter = count_allreduce_bytes()
    ddp = DistributedDataParallel(model)
    hook = spec["hook"]
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=hook["rank"],
        start_powerSGD_iter=hook["start_iter"],
        min_compression_rate=hook["min_compression_rate"],
        use_error_feedback=hook["use_error_feedback"],
        warm_start=hook["warm_start"],
        random_seed=hook["seed"],
        batch_tensors_with_same_shape=False,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = config.optimizer.build(ddp.parameters())
    losses, sent = [], []
    for step in range(spec["steps"]):
        inputs, targets = batches.at(step)
        optimizer.zero_grad()
        before = counter[0]
        loss = workload.loss(ddp(inputs), targets).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        sent.append(counter[0] - before)
    metric = None
    if rank == 0:  # evaluate exactly as the simulation's coordinator does
        replica = Replica(workload, make_strategy("dsgd"), config.optimizer)
        replica.model.load_state_dict(model.state_dict())
        metric = replica.evaluate()[workload.metric_name]
    out = folder / f"ddp_r{hook['rank']}_rank{rank}.json"
    out.write_text(json.dumps({"loss": losses, "allreduce_bytes": sent, "metric": metric}))
    # Every rank is past every collective, then leaves without tearing gloo down: its teardown
    # races the peers' closing sockets and can abort after the results are written.
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]))
