"""PowerSGD: the same compression as PyTorch's powerSGD_hook; exact at full rank; exact bytes.

The key test runs the real hook: two processes, torch.distributed gloo on 127.0.0.1,
a model in DistributedDataParallel with ``powerSGD_hook`` registered, and compares
the averaged gradients it produces step by step (dense warm-up steps, then compressed
steps with error feedback and warm start) with the updates our two in-process sites
reconstruct from the same model, batches and optimizer steps.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.network import free_port
from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout, reference_update, step_update
from dadfl.strategies.powersgd import PowerSGD, orthogonalize, plan
from dadfl.strategies.step import exchange

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

FLOAT = 4

HOOK_WORKER = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    data = torch.load(f"{folder}/inputs.pt", weights_only=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    for run in data["runs"]:
        model = run["model"]
        ddp = DistributedDataParallel(model)
        o = run["options"]
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=o["rank"],
            start_powerSGD_iter=o["start_iter"],
            min_compression_rate=o["min_compression_rate"],
            use_error_feedback=o["use_error_feedback"],
            warm_start=o["warm_start"],
            orthogonalization_epsilon=o["orthogonalization_epsilon"],
            random_seed=o["seed"],
            batch_tensors_with_same_shape=False,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=run["lr"])
        grads = []
        for x, y in run["batches"][rank]:
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()  # mean over the local batch, as DDP expects
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            optimizer.step()
        results.append(grads)
    torch.save(results, f"{folder}/grads{rank}.pt")
    # Both ranks are past every collective, then leave without tearing gloo down: its
    # teardown races the peer's closing socket and can abort ("terminate called without an
    # active exception") after the results are written.
    dist.barrier()
    os._exit(0)
    """
)


def hook_model():
    """Conv + Linear layers; two weights share the matrix shape (8, 18), which makes the
    hook draw their random Q next to each other (it groups a bucket's tensors by shape)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 8, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(288, 20), nn.Tanh(), nn.Linear(20, 18), nn.Tanh(), nn.Linear(18, 8),
    )


def hook_batches(steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(8, 2, 8, 8, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(steps)]
        for _ in range(2)
    ]


# rank 1 and 2: Gram–Schmidt; rank 4: Householder QR, and 8×18 matrices stay dense at rate 2.
HOOK_RUNS = [
    dict(rank=1, steps=6, seed=1),
    dict(rank=4, steps=5, seed=2),
]


def run_options(rank):
    return dict(
        rank=rank, start_iter=2, min_compression_rate=2, use_error_feedback=True,
        warm_start=True, orthogonalization_epsilon=0, seed=0,
    )


@pytest.fixture(scope="module")
def hook_results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    folder = tmp_path_factory.mktemp("powersgd_hook")
    runs = [
        dict(model=hook_model(), options=run_options(r["rank"]), batches=hook_batches(r["steps"], r["seed"]), lr=0.1)
        for r in HOOK_RUNS
    ]
    torch.save({"runs": runs}, folder / "inputs.pt")
    (folder / "worker.py").write_text(HOOK_WORKER)
    # The free port can be taken by another process before gloo binds it (gloo then aborts):
    # a new port, at most three times.
    for _ in range(3):
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, str(folder / "worker.py"), str(rank), port, str(folder)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(2)
        ]
        try:
            outputs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(p.returncode == 0 for p in procs):
            break
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, f"hook worker failed:\n{out}"
    results = [torch.load(folder / f"grads{rank}.pt") for rank in range(2)]
    return runs, results


def replay(run, strategy):
    """Our two in-process sites on the hook run's model, batches and SGD steps."""
    model = hook_model()
    batches = run["batches"]
    layout = probe_layout(model, batches[0][0][0])
    sites = [strategy.site(layout, model) for _ in range(2)]
    server = strategy.server(layout, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=run["lr"])
    for step in range(len(batches[0])):
        step_batches = [batches[rank][step] for rank in range(2)]
        reference = reference_update(model, per_sample_cross_entropy, step_batches)
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, capture=False) for x, y in step_batches]
        messages, _ = exchange(sites, server, locals_, step)
        update = strategy.decode(layout, messages, model)
        yield step, messages, update, reference
        apply_update(model, optimizer, update)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.network
@pytest.mark.parametrize("index", range(len(HOOK_RUNS)))
def test_matches_pytorch_powersgd_hook(hook_results, index):
    runs, results = hook_results
    run, hook = runs[index], results[0][index]
    assert all(
        torch.equal(hook[t][k], results[1][index][t][k]) for t in range(len(hook)) for k in hook[t]
    ), "the hook leaves every rank with the same gradients"
    strategy = PowerSGD(**run["options"])
    compressed = {m.name for m in plan(probe_layout(hook_model(), run["batches"][0][0][0]), strategy.rank, 2).matrices}
    assert compressed and len(compressed) < 4 + (index == 0), "some weights are compressed, biases never"
    worst = {}
    for step, messages, update, reference in replay(run, strategy):
        assert len(messages) == (1 if step < 2 else 2), "warm-up steps are dense, then two phases"
        errors = {name: rel(update[name], hook[step][name]) for name in hook[step]}
        # Rounding differences (the hook differentiates the mean loss, we the summed one)
        # are amplified a little by each orthogonalisation; they stay near fp32 level.
        assert max(errors.values()) <= 2e-5, (step, errors)
        worst[step] = max(errors.values())
        if step >= 2:  # the match is not trivial: compression really changed the gradient
            assert max(rel(update[name], reference[name]) for name in compressed) > 0.05
    assert len(worst) == len(hook)


@pytest.mark.network
def test_hook_match_depends_on_the_seed(hook_results):
    """Same options but another seed: the random Q differs and so do the updates."""
    runs, results = hook_results
    run, hook = runs[0], results[0][0]
    other = PowerSGD(**{**run["options"], "seed": 1})
    errors = [max(rel(u[n], hook[s][n]) for n in hook[s]) for s, _, u, _ in replay(run, other) if s >= 2]
    assert min(errors) > 1e-2, errors


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_full_rank_without_error_feedback_is_exact(kind):
    model = build(kind)
    batches = site_batches(kind, sizes=(5, 1, 3))
    reference = reference_update(model, per_sample_cross_entropy, batches)
    strategy = make_strategy("powersgd", rank=64, start_iter=0, use_error_feedback=False, min_compression_rate=0)
    update = step_update(strategy, model, per_sample_cross_entropy, batches)
    layout = probe_layout(model, batches[0][0])
    assert {m.name for m in plan(layout, 64, 0).matrices} == {n for n in layout.params if n.endswith("weight")}
    errors = {name: rel(update[name], ref) for name, ref in reference.items()}
    assert max(errors.values()) <= 1e-5, errors


def exchange_once(strategy, kind="mlp", sizes=(5, 1, 3), step=0):
    model = build(kind)
    batches = site_batches(kind, sizes=sizes)
    layout = probe_layout(model, batches[0][0])
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, capture=False) for x, y in batches]
    sites = [strategy.site(layout, model) for _ in sizes]
    messages, traffic = exchange(sites, strategy.server(layout, model), locals_, step)
    return model, batches, layout, sites, messages, traffic


def test_one_dimensional_and_small_tensors_go_dense():
    strategy = make_strategy("powersgd", rank=2, start_iter=0)
    _, _, layout, _, messages, _ = exchange_once(strategy)
    p_keys = {k for k in messages[0].tensors if k.endswith(":P")}
    assert p_keys == {"1.weight:P", "3.weight:P"}, "5.weight (5 × 16) does not pay at rank 2, rate 2"
    assert set(messages[0].tensors) == p_keys, "phase 0: P only"
    dense = {f"{name}:grad" for name in ("1.bias", "3.bias", "5.bias", "5.weight")}
    assert set(messages[1].tensors) == {"1.weight:Q", "3.weight:Q"} | dense, "phase 1: Q and the dense gradients"


def test_bytes_match_formula_and_two_phases():
    """MLP 12-16-16-5 at rank 2: 1.weight (16 × 12) and 3.weight (16 × 16) compressed."""
    strategy = make_strategy("powersgd", rank=2, start_iter=1)
    *_, warmup = exchange_once(strategy, step=0)
    dense = 16 * 12 + 16 + 16 * 16 + 16 + 5 * 16 + 5
    assert warmup.up == [[FLOAT * dense] * 3] and warmup.down == [FLOAT * dense], "warm-up: dSGD, one phase"

    *_, traffic = exchange_once(strategy, step=1)
    phase0 = 2 * 16 + 2 * 16  # P of both
    phase1 = 2 * 12 + 2 * 16 + (16 + 16 + 5 * 16 + 5)  # Q of both, the rest dense
    assert traffic.up == [[FLOAT * phase0] * 3, [FLOAT * phase1] * 3]
    assert traffic.down == [FLOAT * phase0, FLOAT * phase1]
    compressed_per_site = 2 * (16 + 12) + 2 * (16 + 16)  # r·(n + m) each
    assert traffic.up_total == 3 * FLOAT * (compressed_per_site + 16 + 16 + 5 * 16 + 5)
    assert traffic.down_per_site == FLOAT * (compressed_per_site + 16 + 16 + 5 * 16 + 5)


def test_error_feedback_keeps_what_compression_left_out():
    """Σ_s (n_s/N) e_s = M̄ − P̂Qᵀ: the update plus the mean error is the exact gradient."""
    strategy = make_strategy("powersgd", rank=1, start_iter=0)
    sizes = (5, 1, 3)
    model, batches, layout, sites, messages, _ = exchange_once(strategy, sizes=sizes)
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = strategy.decode(layout, messages)
    for name in ("1.weight", "3.weight", "5.weight"):
        mean_error = sum(n * site.errors[name] for n, site in zip(sizes, sites)) / sum(sizes)
        assert rel(update[name], reference[name]) > 0.05
        assert rel(update[name] + mean_error.reshape(update[name].shape), reference[name]) <= 1e-5
    # Every site keeps the same warm-start Q: the aggregated one.
    for name in sites[0].q_memory:
        assert all(torch.equal(site.q_memory[name], sites[0].q_memory[name]) for site in sites)
        assert torch.equal(sites[0].q_memory[name], messages[1].tensors[f"{name}:Q"])


def test_warm_start_converges_on_a_fixed_gradient():
    """Repeated steps on the same gradient, no error feedback: warm start is power iteration,
    so the rank-1 approximation approaches the best one; a cold start does not."""
    model = build("mlp")
    batches = site_batches("mlp", sizes=(6, 4))
    layout = probe_layout(model, batches[0][0])
    reference = reference_update(model, per_sample_cross_entropy, batches)
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, capture=False) for x, y in batches]

    def errors(warm):
        strategy = make_strategy("powersgd", rank=1, start_iter=0, use_error_feedback=False, warm_start=warm)
        sites, server = [strategy.site(layout) for _ in batches], strategy.server(layout)
        out = []
        for step in range(6):
            messages, _ = exchange(sites, server, locals_, step)
            out.append(rel(strategy.decode(layout, messages)["3.weight"], reference["3.weight"]))
        return out

    sv = torch.linalg.svdvals(reference["3.weight"])
    best = float(sv[1:].norm() / sv.norm())
    warm, cold = errors(True), errors(False)
    assert warm[0] == cold[0]
    assert warm[-1] <= 1.001 * best < warm[0]
    assert min(cold[1:]) > 1.01 * best


def test_orthogonalize_matches_qr_and_handles_zero_columns():
    g = torch.Generator().manual_seed(0)
    for r in (1, 2, 3):
        X = torch.randn(10, r, generator=g)
        Q = orthogonalize(X)
        assert torch.allclose(Q.T @ Q, torch.eye(r), atol=1e-5)
        assert torch.allclose(Q @ (Q.T @ X), X, atol=1e-5), "same span"
    zero = orthogonalize(torch.zeros(4, 1))
    assert torch.equal(zero, torch.zeros(4, 1)), "no NaN from a vanishing gradient"


def test_options_are_checked():
    with pytest.raises(ValueError, match="rank"):
        make_strategy("powersgd", rank=0)
    with pytest.raises(ValueError, match="no option"):
        make_strategy("powersgd", matrix_approximation_rank=2)


def test_each_site_memory_drops_its_deviation_along_the_basis_and_the_updates_match_the_hooks_memory():
    """memory="site" (e_s = M_s − P̂ Q_sᵀ): each memory is orthogonal to this step's basis P̂,
    while "global" (e_s = M_s − P̂ Qᵀ) keeps every site's deviation along it; both give the same
    updates (their mean memory is the same), to float rounding, step after step."""
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp", sizes=(5,))[0][0])
    runs = {}
    for memory in ("site", "global"):
        strategy = make_strategy("powersgd", rank=1, start_iter=0, memory=memory)
        sites, server = [strategy.site(layout, model) for _ in range(3)], strategy.server(layout, model)
        updates = []
        for step in range(4):
            locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, capture=False)
                       for x, y in site_batches("mlp", sizes=(5, 1, 3), seed=step)]
            messages, _ = exchange(sites, server, locals_, step)
            updates.append(strategy.decode(layout, messages, model))
        p_hat = {m.name: messages[0].tensors[m.p_key] for m in sites[0].plan.matrices}
        along = [float((p_hat[name].T @ site.errors[name]).norm() / site.errors[name].norm())
                 for site in sites for name in p_hat]
        runs[memory] = updates, along
    assert max(runs["site"][1]) <= 1e-5 and min(runs["global"][1]) > 1e-2
    for site_update, global_update in zip(runs["site"][0], runs["global"][0]):
        assert max(rel(site_update[name], global_update[name]) for name in global_update) <= 1e-4


def test_memory_option_is_checked():
    with pytest.raises(ValueError, match="memory='shared' must be one of 'site', 'global'"):
        PowerSGD(memory="shared")
