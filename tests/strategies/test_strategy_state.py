"""The strategy state contract: a fresh half loaded with ``state_dict()`` continues bit-identically."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

SIZES = (6, 2, 4)
CASES = [
    ("dsgd", {}),
    ("dad", {"downlink": "factors"}),
    ("auto", {}),
    ("edad", {}),
    ("rankdad", {"rank": 2, "raw_input": "low_rank", "reduce_on_server": True}),
    ("rankdad", {"rank": 2, "warm_start": False}),
    ("powersgd", {"rank": 1, "start_iter": 1}),
    ("powersgd", {"rank": 2, "start_iter": 0, "warm_start": False}),
]
STATEFUL = {"rankdad", "powersgd"}


def through_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint gives back: torch.save, then a weights-only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run_steps(strategy, model, layout, sites, server, steps):
    """Payloads and messages of ``steps`` (tensors by key), training ``model`` with SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for step in steps:
        batches = site_batches("mlp", sizes=SIZES, seed=step)
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
        uploads = [site.begin(local, step) for site, local in zip(sites, locals_)]
        seen.append([u.tensors for u in uploads])
        messages = finish_step(sites, server, uploads)
        seen.append([m.tensors for m in messages])
        apply_update(model, optimizer, strategy.decode(layout, messages, model))
    return seen


def finish_step(sites, server, payloads):
    """The phases after the uploads of phase 0 (``exchange`` without its ``begin``)."""
    messages = []
    while True:
        message = server.aggregate(payloads)
        messages.append(message)
        replies = [site.receive(message) for site in sites]
        if all(r is None for r in replies):
            return messages
        payloads = replies


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_fresh_half_with_loaded_state_continues_identically(name, options):
    strategy = make_strategy(name, **options)
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp", sizes=SIZES)[0][0])
    sites = [strategy.site(layout, model) for _ in SIZES]
    server = strategy.server(layout, model)
    run_steps(strategy, model, layout, sites, server, range(3))

    site_states = [through_disk(site.state_dict()) for site in sites]
    server_state = through_disk(server.state_dict())
    assert all(isinstance(v, torch.Tensor) for s in site_states + [server_state] for v in s.values())
    if name in STATEFUL:
        assert any(site_states), f"{name} carries state between steps"
    else:
        assert not any(site_states) and not server_state, f"{name} is stateless"

    model_copy, fresh_copy = copy.deepcopy(model), copy.deepcopy(model)
    restored_sites = [strategy.site(layout, model_copy) for _ in SIZES]
    restored_server = strategy.server(layout, model_copy)
    for half, state in zip(restored_sites, site_states):
        half.load_state_dict(state)
    restored_server.load_state_dict(server_state)
    expected = run_steps(strategy, model, layout, sites, server, range(3, 5))
    resumed = run_steps(strategy, model_copy, layout, restored_sites, restored_server, range(3, 5))
    assert same(expected, resumed), "a restored half must send and aggregate exactly what the original does"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model_copy.state_dict().values()))

    if name in STATEFUL:  # the comparison can fail: without the state, the halves diverge
        fresh = run_steps(
            strategy, fresh_copy, layout, [strategy.site(layout, fresh_copy) for _ in SIZES],
            strategy.server(layout, fresh_copy), range(3, 5),
        )
        assert not same(expected, fresh)


def test_state_of_another_configuration_is_refused():
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp", sizes=SIZES)[0][0])
    stateless = make_strategy("dad").site(layout, model)
    with pytest.raises(ValueError, match="keeps no state"):
        stateless.load_state_dict({"errors/x": torch.zeros(1)})
    rank1 = make_strategy("powersgd", rank=1, start_iter=0)
    rank2 = make_strategy("powersgd", rank=2, start_iter=0)
    sites = [rank1.site(layout, model) for _ in SIZES]
    run_steps(rank1, copy.deepcopy(model), layout, sites, rank1.server(layout, model), range(1))
    with pytest.raises(ValueError, match="does not fit"):
        rank2.site(layout, model).load_state_dict(sites[0].state_dict())
    with pytest.raises(ValueError, match="unknown keys"):
        make_strategy("rankdad").site(layout, model).load_state_dict(sites[0].state_dict())


def test_site_states_on_disk_are_per_site_and_run_bounded_and_survive_a_new_process(tmp_path):
    from dadfl.client.half_states import HalfStates

    cpu = torch.device("cpu")
    states = HalfStates(tmp_path, "site-a", "run1", cpu)
    for step in range(1, 6):
        states.save(step, {"errors/w": torch.full((2,), float(step))})
    states.keep_only({2, 5})
    assert states.steps() == {0, 2, 5}
    again = HalfStates(tmp_path, "site-a", "run1", cpu)  # a restarted site process
    assert again.steps() == {0, 2, 5} and torch.equal(again.load(5)["errors/w"], torch.full((2,), 5.0))
    (tmp_path / "site-a" / "run-run1" / "half-2.pt").write_bytes(b"torn")
    assert again.load(2) is None and again.load(3) is None
    HalfStates(tmp_path, "site-a", "run2", cpu)  # a new run: the old run's states go
    assert not (tmp_path / "site-a" / "run-run1").exists()
    assert HalfStates(tmp_path, "site-b", "run1", cpu).steps() == {0}, "another site's states are not this site's"
    odd = HalfStates(tmp_path, "site-a", "../escape", cpu)  # not a plain name: memory only
    odd.save(1, {})
    assert odd.folder is None and not (tmp_path.parent / "escape").exists()


def test_site_state_files_are_written_over_not_remade_and_a_damaged_or_misnamed_one_reads_as_lost(tmp_path):
    from dadfl.client.half_states import HalfStates

    cpu = torch.device("cpu")
    states = HalfStates(tmp_path, "site-a", "run1", cpu)
    state = {"error/w": torch.arange(6.0).reshape(2, 3), "rng/cpu": torch.Generator().get_state()}
    inodes = set()
    for step in range(1, 12):
        states.save(step, {**state, "error/w": state["error/w"] + step})
        states.keep_only({1, step - 1, step})
        inodes.add((states.folder / f"half-{step}.pt").stat().st_ino)
    files = sorted(p.name for p in states.folder.iterdir())
    assert files == ["half-1.pt", "half-10.pt", "half-11.pt", "spare-9"], files
    assert len(inodes) <= 5, "after the first steps every save writes over a dropped file"
    again = HalfStates(tmp_path, "site-a", "run1", cpu)  # a restarted site process
    loaded = again.load(11)
    assert torch.equal(loaded["error/w"], state["error/w"] + 11) and torch.equal(loaded["rng/cpu"], state["rng/cpu"])
    damaged = bytearray((again.folder / "half-10.pt").read_bytes())
    damaged[-40] ^= 1  # one bit of a tensor
    (again.folder / "half-10.pt").write_bytes(bytes(damaged))
    assert again.load(10) is None
    os.replace(again.folder / "half-11.pt", again.folder / "half-7.pt")  # a file under another step's name
    assert HalfStates(tmp_path, "site-a", "run1", cpu).load(7) is None
    again.save(12, {})  # a stateless half's empty state is a state too
    assert HalfStates(tmp_path, "site-a", "run1", cpu).load(12) == {}


CHECKPOINT_EVERY = 6


def replayed_steps(tmp_path, seed: int, rounds: int):
    """The steps a site sees in ``rounds`` rounds, as ``(states, step, checkpoint)`` before it
    saves the state of ``step + 1``: the steps go back (a coordinator resumed from its
    checkpoint, every ``CHECKPOINT_EVERY`` steps) and the site's process restarts (a new
    ``HalfStates`` over the same folder); the site kept ``{checkpoint, step - 1, step}``."""
    import random

    from dadfl.client.half_states import HalfStates

    rng, cpu = random.Random(seed), torch.device("cpu")
    states = HalfStates(tmp_path, "site-a", "run1", cpu)
    step = checkpoint = 0
    for _ in range(rounds):
        draw = rng.random()
        if draw < 0.05:  # a restarted site process, maybe behind the server
            states = HalfStates(tmp_path, "site-a", "run1", cpu)
            step = max(checkpoint, step - rng.randint(0, 3))
        elif draw < 0.12:  # the coordinator resumes from its checkpoint
            step = checkpoint
        states.keep_only({checkpoint, step - 1, step})
        yield states, step, checkpoint
        if (step + 1) % CHECKPOINT_EVERY == 0:
            checkpoint = step + 1
        step += 1


@pytest.mark.parametrize("seed", range(8))
def test_site_states_survive_replays_and_restarts_in_any_order(tmp_path, seed):
    """The steps a site sees go back (a coordinator resumed from its checkpoint, an aborted
    step) and its process restarts; a step dropped twice once left its spare file listed twice,
    and the second reuse of it stopped the site on FileNotFoundError."""
    for states, step, checkpoint in replayed_steps(tmp_path, seed, 150):
        states.save(step + 1, {"error/w": torch.full((2,), float(step + 1))})
        states.keep_only({checkpoint if (step + 1) % CHECKPOINT_EVERY else step + 1, step, step + 1})
        assert len(set(states.spares)) == len(states.spares) and all(spare.exists() for spare in states.spares)
        for kept in states.steps() - {0}:
            assert torch.equal(states.load(kept)["error/w"], torch.full((2,), float(kept)))
    assert len(list(states.folder.iterdir())) <= 5, "three states and two spares at most"


def test_empty_states_are_renamed_files_and_never_take_a_stateful_states_bytes(tmp_path):
    """A stateless half's saves rename the dropped empty file into place (same inode, no new
    file); a stateful state after them, and an empty one after a stateful one, read back as saved."""
    from dadfl.client.half_states import HalfStates

    cpu = torch.device("cpu")
    states = HalfStates(tmp_path, "site-a", "run1", cpu)
    inodes = set()
    for step in range(1, 10):
        states.save(step, {})
        states.keep_only({step - 1, step})
        inodes.add((states.folder / f"half-{step}.pt").stat().st_ino)
    assert len(inodes) <= 3, "after the first steps an empty state is a renamed file"
    states.save(10, {"error/w": torch.full((3,), 10.0)})  # e.g. a reset to a stateful half
    states.keep_only({9, 10})
    states.save(11, {})
    states.keep_only({10, 11})
    states.save(12, {})
    states.keep_only({11, 12})
    again = HalfStates(tmp_path, "site-a", "run1", cpu)  # a restarted site process
    assert again.steps() == {0, 11, 12} and again.load(11) == {} and again.load(12) == {}
    assert (again.folder / "half-12.pt").stat().st_size == 0
    again.save(13, {"error/w": torch.full((3,), 13.0)})
    again.keep_only({12, 13})
    again.save(14, {})
    again.keep_only({13, 14})
    assert torch.equal(HalfStates(tmp_path, "site-a", "run1", cpu).load(13)["error/w"], torch.full((3,), 13.0))
    assert HalfStates(tmp_path, "site-a", "run1", cpu).load(14) == {}


@pytest.mark.parametrize("seed", range(4))
def test_empty_states_move_by_one_rename_through_replays_and_restarts(tmp_path, seed):
    """A stateless half's save (``keep``) renames the empty file of a state it drops (the same
    inode under the new step's name); replays and restarts keep every kept step restorable."""
    from dadfl.client.half_states import HalfStates

    renamed = 0
    for states, step, checkpoint in replayed_steps(tmp_path, seed, 80):
        inodes = {kept: (states.folder / f"half-{kept}.pt").stat().st_ino for kept in states.on_disk}
        states.save(step + 1, {}, keep={checkpoint, step})
        assert states.steps() - {0} <= {checkpoint, step, step + 1}
        dropped = {inodes[gone] for gone in set(inodes) - states.on_disk}
        if dropped and step + 1 not in inodes:
            renamed += (states.folder / f"half-{step + 1}.pt").stat().st_ino in dropped
        for kept in states.steps() - {0}:
            assert states.load(kept) == {}
        assert len(list(states.folder.iterdir())) <= 5, "three states and two spares at most"
    assert renamed > 40, "most steps take over the dropped state's file"
    assert HalfStates(tmp_path, "site-a", "run1", torch.device("cpu")).load(step + 1) == {}
