"""The built-in workloads: loading, deterministic replicas, losses, trainability, model shapes."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from dadfl.workloads import BUILTIN, LARGE, Split, Workload, load_workload
from dadfl.workloads.common import scikit_learn_table, stratified_split
from dadfl.workloads.text import LinearGRUCell, vocabulary


TESTED = [name for name in BUILTIN if name not in LARGE]  # the large ones: test_state_file.py counts their parameters


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    return {name: load_workload(name) for name in TESTED}


def train_batch(workload: Workload, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return workload.train.inputs[:size], workload.train.targets[:size]


@pytest.mark.parametrize("name", TESTED)
def test_builtin_loads_with_consistent_splits(workloads, name):
    workload = workloads[name]
    assert workload.name == name
    for split in (workload.train, workload.test):
        assert isinstance(split, Split) and len(split) > 0
        assert split.targets.dtype == torch.int64
    assert workload.train.inputs.shape[1:] == workload.test.inputs.shape[1:]
    if workload.labels is not None:
        assert torch.equal(workload.labels, workload.train.targets)


@pytest.mark.parametrize("name", TESTED)
def test_replicas_are_bit_identical_and_leave_global_rng_alone(workloads, name):
    rng_before = torch.get_rng_state()
    first, second = workloads[name].build_model(), workloads[name].build_model()
    assert torch.equal(torch.get_rng_state(), rng_before)
    first_state, second_state = first.state_dict(), second.state_dict()
    assert list(first_state) == list(second_state)
    for key in first_state:
        assert torch.equal(first_state[key], second_state[key]), key


def test_model_seed_changes_the_initial_weights():
    first = load_workload("digits-mlp", seed=0).build_model()
    second = load_workload("digits-mlp", seed=1).build_model()
    assert not torch.equal(first[0].weight, second[0].weight)


@pytest.mark.parametrize("name", TESTED)
def test_forward_gives_one_loss_per_sample_and_a_bounded_metric(workloads, name):
    workload = workloads[name]
    inputs, targets = train_batch(workload, size=7)
    outputs = workload.build_model()(inputs)
    losses = workload.loss(outputs, targets)
    assert losses.shape == (7,)
    assert torch.isfinite(losses).all() and (losses > 0).all()
    assert 0.0 <= workload.metric(outputs, targets) <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", TESTED)
def test_a_few_dozen_sgd_steps_reduce_the_loss(workloads, name):
    workload = workloads[name]
    inputs, targets = train_batch(workload)
    model = workload.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = workload.loss(model(inputs), targets).mean().item()
    for _ in range(40):
        optimizer.zero_grad()
        loss = workload.loss(model(inputs), targets).mean()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.75 * initial


@pytest.mark.parametrize("name", TESTED)
def test_data_is_deterministic_by_seed(name):
    options = {"max_sequences": 100} if name.startswith("char") else {}
    first, again = load_workload(name, **options), load_workload(name, **options)
    other = load_workload(name, seed=1, **options)
    assert torch.equal(first.train.inputs, again.train.inputs)
    assert torch.equal(first.test.targets, again.test.targets)
    assert not torch.equal(first.train.inputs, other.train.inputs)


def test_digits_pixels_are_scaled_and_the_split_is_stratified(workloads):
    workload = workloads["digits-mlp"]
    assert workload.train.inputs.min() == 0.0 and workload.train.inputs.max() == 1.0
    assert len(workload.test) / (len(workload.train) + len(workload.test)) == pytest.approx(0.25, abs=0.01)
    train_share = torch.bincount(workload.train.targets, minlength=10) / len(workload.train)
    test_share = torch.bincount(workload.test.targets, minlength=10) / len(workload.test)
    assert torch.allclose(train_share, test_share, atol=0.01)


@pytest.mark.parametrize("name", ["digits", "breast_cancer"])
def test_bundled_tables_are_scikit_learns_arrays_read_without_importing_it(name):
    from sklearn import datasets

    features, labels = scikit_learn_table(name)
    reference = getattr(datasets, f"load_{name}")()
    assert features.dtype == reference.data.dtype and labels.dtype == reference.target.dtype
    assert np.array_equal(features, reference.data) and np.array_equal(labels, reference.target)


LABELS = {  # real labels, and classes of sizes whose shares tie (the draw that breaks the tie)
    "digits": scikit_learn_table("digits")[1],
    "breast_cancer": scikit_learn_table("breast_cancer")[1],
    "ties": np.repeat(np.arange(6), [2, 3, 3, 7, 7, 10]),
}


@pytest.mark.parametrize("labels", LABELS, ids=str)
def test_the_stratified_split_is_scikit_learns_index_for_index(labels):
    """Splits (so results) made with scikit-learn's train_test_split stay as they were."""
    from sklearn.model_selection import train_test_split

    classes = LABELS[labels]
    rows = np.arange(len(classes))
    for seed in range(4):
        for fraction in (0.1, 0.25, 0.3, 0.5):
            if min(math.ceil(fraction * len(classes)), len(classes) - math.ceil(fraction * len(classes))) < len(set(classes)):
                continue  # too few rows in a part for every class: both refuse
            ours = stratified_split(rows, classes, fraction, seed)
            theirs = train_test_split(rows, classes, test_size=fraction, random_state=seed, stratify=classes)
            assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)), (labels, seed, fraction)


def test_a_stratified_split_refuses_a_class_of_one_row():
    with pytest.raises(ValueError, match="class 3 has 1 row"):
        stratified_split(np.arange(7), np.array([0, 0, 1, 1, 2, 2, 3]), 0.5, 0)


def test_digits_cnn_sees_images_through_a_strided_and_a_grouped_conv(workloads):
    workload = workloads["digits-cnn"]
    assert workload.train.inputs.shape[1:] == (1, 8, 8)
    convs = [m for m in workload.build_model().modules() if isinstance(m, nn.Conv2d)]
    assert any(conv.stride == (2, 2) and conv.padding == (1, 1) for conv in convs)
    assert any(conv.groups == 2 for conv in convs)


@pytest.mark.parametrize("name", ["digits-mlp", "breast-cancer-mlp"])
def test_mlps_are_sequentials_of_linear_and_elementwise_layers(workloads, name):
    model = workloads[name].build_model()
    assert type(model) is nn.Sequential
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_breast_cancer_features_are_standardised_with_train_statistics(workloads):
    workload = workloads["breast-cancer-mlp"]
    assert workload.train.inputs.shape[1] == 30
    assert torch.allclose(workload.train.inputs.mean(dim=0), torch.zeros(30), atol=1e-5)
    assert torch.allclose(workload.train.inputs.std(dim=0, correction=0), torch.ones(30), atol=1e-4)
    assert not torch.allclose(workload.test.inputs.mean(dim=0), torch.zeros(30), atol=1e-3)


@pytest.mark.parametrize("name", ["char-gru", "char-transformer"])
def test_text_targets_are_the_inputs_shifted_by_one(workloads, name):
    workload = workloads[name]
    vocab_size = workload.build_model().embed.num_embeddings
    assert workload.train.inputs.shape == (3200, 32) and workload.test.inputs.shape == (800, 32)
    assert torch.equal(workload.train.targets[:, :-1], workload.train.inputs[:, 1:])
    assert workload.train.inputs.dtype == torch.int64
    assert 0 <= workload.train.inputs.min() and workload.train.inputs.max() < vocab_size
    assert workload.labels is None


def test_vocabulary_maps_rare_characters_to_the_unknown_id():
    assert vocabulary("bbaaac", min_char_count=2) == {"a": 1, "b": 2}


def test_linear_gru_cell_matches_torch_gru_cell():
    torch.manual_seed(0)
    cell, reference = LinearGRUCell(5, 7), nn.GRUCell(5, 7)
    with torch.no_grad():
        reference.weight_ih.copy_(cell.input_to_gates.weight)
        reference.bias_ih.copy_(cell.input_to_gates.bias)
        reference.weight_hh.copy_(cell.hidden_to_gates.weight)
        reference.bias_hh.copy_(cell.hidden_to_gates.bias)
    inputs, hidden = torch.randn(4, 5), torch.randn(4, 7)
    torch.testing.assert_close(cell(inputs, hidden), reference(inputs, hidden))


def test_gru_calls_every_linear_module_once_per_time_step(workloads):
    model = workloads["char-gru"].build_model()
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert len(linears) == 3
    calls = dict.fromkeys(linears, 0)
    for name, module in linears.items():
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    inputs, _ = train_batch(workloads["char-gru"], size=3)
    model(inputs[:, :11])
    assert calls == dict.fromkeys(linears, 11)


def test_transformer_head_is_tied_to_the_token_embedding(workloads):
    model = workloads["char-transformer"].build_model()
    assert model.head.weight is model.embed.weight
    assert model.head.bias is None


def test_transformer_attends_only_to_earlier_positions(workloads):
    model = workloads["char-transformer"].build_model()
    inputs, _ = train_batch(workloads["char-transformer"], size=2)
    changed = inputs.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % model.embed.num_embeddings
    with torch.no_grad():
        original_logits, changed_logits = model(inputs), model(changed)
    torch.testing.assert_close(original_logits[:, :20], changed_logits[:, :20])
    assert not torch.allclose(original_logits[:, 20:], changed_logits[:, 20:])


def test_transformer_attention_runs_through_linear_modules_only(workloads):
    model = workloads["char-transformer"].build_model()
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    linear_names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {"query", "key", "value", "output"}
    assert {f"blocks.0.attention.{name}" for name in expected} | {"blocks.1.mlp_out", "head"} <= linear_names


@pytest.mark.parametrize(
    ("spec", "options", "error", "message"),
    [
        ("no-such-workload", {}, ValueError, "neither a built-in"),
        ("no_such_package.module:factory", {}, ValueError, "cannot import module"),
        ("dadfl.workloads.digits:no_such_factory", {}, ValueError, "has no attribute 'no_such_factory'"),
        ("dadfl.workloads.text:corpus", {}, TypeError, "not a Workload"),
        ("digits-mlp", {"test_fraction": 1.5}, ValueError, "test_fraction"),
        ("digits-mlp", {"hidden": 0}, ValueError, "hidden"),
        ("digits-cnn", {"channels": 3}, ValueError, "channels must be even"),
        ("char-transformer", {"d_model": 30, "heads": 4}, ValueError, "divisible by heads"),
        ("char-gru", {"max_sequences": 1}, ValueError, "raise max_sequences"),
    ],
)
def test_bad_specs_and_options_get_clear_errors(spec, options, error, message):
    with pytest.raises(error, match=message):
        load_workload(spec, **options)


@pytest.mark.parametrize(
    ("package", "source", "message"),
    [
        ("missing_import", "import torchvisionn\n",
         r"module 'missing_import.net' was found, but it imports 'torchvisionn', which is not installed"),
        ("syntax_error", "def build(:\n    pass\n",
         r"module 'syntax_error.net' does not compile: .* \(net.py, line 1\); fix that file"),
    ],
)
def test_a_workload_module_that_fails_to_import_says_why(tmp_path, package, source, message):
    """A module that is found but cannot run is not 'cannot import': the error names its own missing import or
    its syntax error, not the workload path."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "net.py").write_text(source)
    with pytest.raises(ValueError, match=message):
        load_workload(f"{package}.net:build", search_path=[tmp_path])


def test_an_import_path_spec_loads_with_options():
    workload = load_workload("dadfl.workloads.digits:mlp", hidden=8)
    assert workload.build_model()[0].out_features == 8
    assert workload.options["hidden"] == 8


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_factory_has_resolvable_hints_so_options_are_type_checked(name):
    """An annotation that does not resolve makes option checking fall back to names only."""
    import importlib
    import typing

    from dadfl.options import factory_options

    module, function = BUILTIN[name].split(":")
    factory = getattr(importlib.import_module(module), function)
    hints = typing.get_type_hints(factory)
    assert hints["seed"] is int
    with pytest.raises(ValueError, match="seed"):
        factory_options(factory, {"seed": "abc"}, name)


def test_a_factory_whose_hints_do_not_resolve_is_checked_by_name_and_says_so(caplog):
    from dadfl.options import factory_options

    def factory(hidden: "NotDefinedAnywhere" = 4):  # noqa: F821
        return hidden

    with caplog.at_level("WARNING", logger="dadfl.options"):
        assert factory_options(factory, {"hidden": "abc"}, "my_wl:factory") == {"hidden": "abc"}
    assert "my_wl:factory: the annotations of" in caplog.text and "checked by name only, not by type" in caplog.text
    with pytest.raises(ValueError, match="width"):
        factory_options(factory, {"width": 3}, "my_wl:factory")
