"""Strategy capabilities are attributes of the strategy classes (``exact``, ``supports_dp``,
``has_local_steps``, ``phases``): [dp] and the runtimes read them, so a user's own strategy
states what it supports. Each registered strategy's claims are checked against what it does."""

import pytest
import torch

from dadfl.privacy.accounting import check_dp_strategy, dp_strategies
from dadfl.strategies import STRATEGIES, exchange, local_step, make_strategy, reference_update, step_update
from dadfl.strategies.dsgd import DSGD
from dadfl.strategies.local_steps import FedAvg
from dadfl.strategies.step import layout_for

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches


@pytest.mark.parametrize("name", [name for name, cls in STRATEGIES.items() if cls.exact])
def test_a_strategy_that_says_exact_reconstructs_the_reference(name):
    model = build("mlp")
    batches = site_batches("mlp")
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy(name), model, per_sample_cross_entropy, batches)
    for param, expected in reference.items():
        torch.testing.assert_close(update[param], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,options", [(name, {"start_iter": 0} if name == "powersgd" else {}) for name in STRATEGIES])
def test_a_step_takes_at_most_the_phases_its_class_states(name, options):
    strategy = make_strategy(name, **options)
    model = build("mlp")
    batches = site_batches("mlp")
    layout = layout_for(model, batches[0])
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, strategy.needs_factors) for x, y in batches]
    messages, _ = exchange([strategy.site(layout, model) for _ in batches], strategy.server(layout, model), locals_, step=0)
    assert len(messages) <= type(strategy).phases
    if name == "powersgd":  # compressed from step 0: P_s, then Q_s
        assert len(messages) == 2


def test_dp_follows_what_a_strategy_class_declares(monkeypatch):
    class Mine(DSGD):  # inherits dSGD's exact clipped sum
        name = "mine"

    class MineLowRank(DSGD):
        name = "mine_low_rank"
        supports_dp = False

    class MineLocal(FedAvg):
        name = "mine_local"

    for cls in (Mine, MineLowRank, MineLocal):
        monkeypatch.setitem(STRATEGIES, cls.name, cls)
    check_dp_strategy("mine")
    assert "mine" in dp_strategies() and "mine_low_rank" not in dp_strategies()
    with pytest.raises(ValueError, match=r"strategy 'mine_low_rank' cannot run with \[dp\]: its update is a low-rank"):
        check_dp_strategy("mine_low_rank")
    with pytest.raises(ValueError, match=r"strategy 'mine_local' cannot run with \[dp\]: .*several local steps"):
        check_dp_strategy("mine_local")
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        check_dp_strategy("nope")
