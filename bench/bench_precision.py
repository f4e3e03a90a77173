"""Mixed precision on every built-in workload (a benchmark, not a test).

    python bench/bench_precision.py [--precision bf16] [--sites 4] [--batch-size 32] [--device cuda] [--check]

One step of ``--sites`` sites (iid shares, ``--batch-size`` samples each, seed 0) at the given
precision, per built-in workload. Printed as a Markdown table, per workload:

- captured layers, and how many travel dense for a dtype reason (the probe's reasons);
- the largest relative error, over parameters, of dAD's and auto's update against autograd's
  mean-loss gradient under the same autocast (``step.reference_update``), against the
  dtype's tolerance (``precision.tolerance``); a parameter whose true gradient is ~0 is
  measured against 1e-3 of the whole update's norm;
- rank-dAD's (r = 4, an approximation) relative error against autograd's, at this precision
  and in fp32 (each against the reference of its own precision);
- bytes: every site's factors (raw input allowed, so every captured layer shares them) at
  this precision over fp32's, and dAD's whole upload with the default raw-input guard.

``--device`` runs models and batches there (autocast on that device); ``--check`` exits 1 when
a layer travels dense for its dtype or dAD's or auto's error exceeds the tolerance
(``bench/gpu_check.sh`` runs it on a CUDA device).
"""

from __future__ import annotations

import argparse

import torch

from dadfl.strategies import local_step, make_strategy, reference_update, step_update
from dadfl.strategies.precision import compute_dtype, tolerance
from dadfl.strategies.step import exchange, layout_for
from dadfl.workloads import BUILTIN, load_workload, partition, site_batches

DTYPE_WORDS = ("dtype", "float", "bfloat", "autocast")


def max_relative_error(update: dict, reference: dict) -> float:
    floor = 1e-3 * float(torch.sqrt(sum(r.double().norm() ** 2 for r in reference.values())))
    return max(float((update[k].double() - r.double()).norm()) / max(float(r.double().norm()), floor) for k, r in reference.items())


def batches_of(workload, sites: int, batch_size: int, device: torch.device) -> list:
    train = workload.training_data()
    shares = partition(sites, len(train), "iid", labels=workload.labels, seed=0)
    return [tuple(t.to(device) for t in site_batches(train, share, batch_size, seed=s).at(0)) for s, share in enumerate(shares)]


def upload_bytes(strategy, model, loss, batches, precision: str) -> tuple[int, int]:
    """(every site's factor bytes, every site's whole upload) of one step."""
    layout = layout_for(model, batches[0], precision)
    locals_ = [local_step(model, layout, loss, x, y, precision=precision) for x, y in batches]
    factors = sum(f.nbytes() for local in locals_ for f in local.factors.values())
    _, traffic = exchange([strategy.site(layout, model) for _ in batches], strategy.server(layout, model), locals_, step=0)
    return factors, traffic.up_total


def measure(name: str, precision: str, sites: int, batch_size: int, device: torch.device) -> dict:
    workload = load_workload(name)
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    batches = batches_of(workload, sites, batch_size, device)
    layout = layout_for(model, batches[0], precision)
    dense_for_dtype = [p for p, why in layout.dense_reasons if any(w in why for w in DTYPE_WORDS)]
    reference = reference_update(model, workload.loss, batches, precision)
    row = {
        "workload": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "captured": len(layout.layers),
        "dense_for_dtype": len(dense_for_dtype),
    }
    for strategy in ("dad", "auto"):
        update = step_update(make_strategy(strategy), model, workload.loss, batches, precision)
        row[strategy] = max_relative_error(update, reference)
    rankdad = make_strategy("rankdad", rank=4)
    row["rankdad"] = max_relative_error(step_update(rankdad, model, workload.loss, batches, precision), reference)
    row["rankdad_fp32"] = max_relative_error(
        step_update(rankdad, model, workload.loss, batches), reference_update(model, workload.loss, batches)
    )
    shared = make_strategy("dad", raw_input="activations")
    factors, _ = upload_bytes(shared, model, workload.loss, batches, precision)
    factors_fp32, _ = upload_bytes(shared, model, workload.loss, batches, "fp32")
    _, upload = upload_bytes(make_strategy("dad"), model, workload.loss, batches, precision)
    _, upload_fp32 = upload_bytes(make_strategy("dad"), model, workload.loss, batches, "fp32")
    row["factor_bytes"] = factors / factors_fp32
    row["dad_upload"] = upload / upload_fp32
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check", action="store_true", help="exit 1 on a dense-for-dtype layer or an error above the tolerance")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rtol = tolerance(compute_dtype(args.precision))
    print(f"{args.precision} on {device}, {args.sites} sites × {args.batch_size} samples, one step; tolerance {rtol:.3g}\n")
    print("| workload | parameters | captured layers | dense for dtype | dAD max rel. error | auto max rel. error "
          "| rank-dAD r=4 max rel. error (fp32) | factor bytes vs fp32 | dAD upload vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    failures = []
    for name in BUILTIN:
        r = measure(name, args.precision, args.sites, args.batch_size, device)
        if r["dense_for_dtype"] or max(r["dad"], r["auto"]) > rtol:
            failures.append(name)
        print(f"| {r['workload']} | {r['parameters']:,} | {r['captured']} | {r['dense_for_dtype']} | {r['dad']:.2g} | "
              f"{r['auto']:.2g} | {r['rankdad']:.2g} ({r['rankdad_fp32']:.2g}) | {r['factor_bytes']:.3f} | {r['dad_upload']:.3f} |")
    if args.check and failures:
        raise SystemExit(f"{args.precision} on {device}: a layer dense for its dtype or an error above {rtol:.3g} on {', '.join(failures)}")


if __name__ == "__main__":
    main()
