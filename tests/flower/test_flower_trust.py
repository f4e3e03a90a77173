"""A hostile Flower node cannot make the ServerApp hold unbounded tensors, crash on a malformed
reply, or poison the model: its reply is read and bounded before any tensor is decoded, then
screened as the gRPC coordinator screens uploads, and a refusal stops the run with one line
naming the node and the reason (the Flower runtime has no dropout tolerance).

Honest runs stay bit-identical to the in-process simulation: test_flower.py asserts that with
these checks in place."""

from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower integration needs flwr: pip install -e '.[flower]'")

from flwr.app import Array, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from dadfl import flower  # noqa: E402
from dadfl.metrics import MetricsWriter  # noqa: E402
from dadfl.protos import tensor_pb2 as pb  # noqa: E402
from dadfl.protos.codec import WireError, decode_chunks, encode_payload  # noqa: E402
from dadfl.simulation import StrategySpec  # noqa: E402
from dadfl.strategies import Payload  # noqa: E402
from tests.flower.test_flower import DirectGrid, run_direct, small_config, task_identity  # noqa: E402,F401

HOSTILE = 7  # the hostile node of the direct grid (nodes 7, 19, 31)


def tensors(content):
    return content.array_records[flower.TENSORS]


def largest_float(content) -> str:
    arrays = tensors(content)
    return max((k for k, a in arrays.items() if a.numpy().dtype.kind == "f"), key=lambda k: arrays[k].numpy().size)


def wrong_shape(content):
    key = largest_float(content)
    tensors(content)[key] = Array(np.ascontiguousarray(tensors(content)[key].numpy()[..., :-1]))


def extra_tensor(content):
    tensors(content)["evil:grad"] = Array(np.zeros(3, np.float32))


def non_finite(content):
    key = largest_float(content)
    values = tensors(content)[key].numpy().copy()
    values.flat[0] = np.nan
    tensors(content)[key] = Array(values)


def far_out(content):
    for key, array in list(tensors(content).items()):
        values = array.numpy()
        if values.dtype.kind == "f":
            tensors(content)[key] = Array(values * np.float32(1e6))


def wrong_dtype(content):
    key = largest_float(content)
    tensors(content)[key] = Array(tensors(content)[key].numpy().astype(np.float64))


def lying_npy(content):
    """An .npy header that claims a terabyte-sized array over four bytes of data."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": (1 << 38,)})
    key = largest_float(content)
    tensors(content)[key] = Array(dtype="float32", shape=(1 << 38,), stype="numpy.ndarray", data=buffer.getvalue() + bytes(4))


def text_sample_count(content):
    content.config_records[flower.HEADER]["num_samples"] = "16"


def too_many_samples(content):
    content.config_records[flower.HEADER]["num_samples"] = 10**6


def stray_record(content):
    content.config_records["extra"] = content.config_records[flower.HEADER]


ATTACKS = [
    (wrong_shape, r"tensor '.*': shape \(.*\), expected"),
    (extra_tensor, r"unexpected tensor 'evil:grad'"),
    (non_finite, r"contains NaN or Inf"),
    (far_out, r"contribution out of bounds: its update norm .* is more than 100× the median"),
    (wrong_dtype, r"dtype float64, expected torch.float32"),
    (lying_npy, r"shape \(274877906944,\) needs 1099511627776 bytes, it carries 4"),
    (text_sample_count, r"header field 'num_samples' is not an integer"),
    (too_many_samples, r"num_samples=1000000 is outside 1..16"),
    (stray_record, r"unexpected record 'extra'"),
]


class HostileGrid(DirectGrid):
    """The direct grid, with node ``HOSTILE``'s reply to the step message of ``step`` altered by ``attack``."""

    def __init__(self, attack, step: int = 1):
        super().__init__(3)
        self.attack, self.step = attack, step

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for message, reply in zip(messages, replies):
            if (message.metadata.message_type, int(message.metadata.group_id), message.metadata.dst_node_id) == (
                flower.STEP_MESSAGE, self.step, HOSTILE,
            ):
                self.attack(reply.content)
        return replies


def assert_refused(error: flower.FlowerRunError, step: int, pattern: str) -> None:
    text = str(error)
    assert text.startswith(f"step {step} phase 0: node {HOSTILE} refused: "), text
    assert re.search(pattern, text), text
    assert "\n" not in text and len(text) < 400, text  # one line, no tensor dump


@pytest.mark.parametrize("attack, reason", ATTACKS, ids=[attack.__name__ for attack, _ in ATTACKS])
def test_a_hostile_reply_stops_the_run_naming_the_node_and_the_reason(tmp_path, task_identity, attack, reason):
    spec = StrategySpec(name="dad")
    grid = HostileGrid(attack)
    with pytest.raises(flower.FlowerRunError) as raised:
        run_direct(tmp_path, small_config(spec, sites=3), spec, grid)
    assert_refused(raised.value, 1, reason)


def test_a_payload_over_the_byte_cap_is_refused_before_it_is_decoded(tmp_path, task_identity):
    spec = StrategySpec(name="dad")
    bounds = flower.ServerBounds(max_payload_bytes=1024)  # an honest dAD upload here is a few kB
    with pytest.raises(flower.FlowerRunError, match=r"step 0 phase 0: node 7 refused: payload of \d+ bytes exceeds the limit of 1024"):
        run_direct(tmp_path, small_config(spec, sites=3), spec, DirectGrid(3), bounds)


def test_the_run_configs_update_norm_bound_refuses_an_honest_sized_update_over_it(tmp_path, task_identity):
    """``max-update-norm`` reaches the screening: with a bound below every honest update the
    first node's upload is refused, naming the bound; with the default (none) the run trains."""
    spec = StrategySpec(name="dad")
    _, _, bounds = flower.settings_from_run_config({"max-update-norm": 1e-6})
    with pytest.raises(flower.FlowerRunError, match=r"step 0 phase 0: node 7 refused: contribution out of bounds: its update "
                                                    r"norm [\d.]+ exceeds federation.max_update_norm=1e-06"):
        run_direct(tmp_path / "bounded", small_config(spec, sites=3), spec, DirectGrid(3), bounds)
    summary, records = run_direct(tmp_path / "default", small_config(spec, sites=3), spec, DirectGrid(3))
    assert len(records) == 3 and summary["steps"] == 3


def test_a_payload_the_rules_miss_is_caught_by_the_message_check(tmp_path, task_identity, monkeypatch):
    """With rank-dAD's upload rules switched off, a P without its Q breaks the aggregation:
    the server finds whose upload breaks it and never sends the message."""
    from dadfl.strategies.rankdad import RankDAD

    monkeypatch.setattr(RankDAD, "check_uploads", lambda self, *args, **kwargs: [])
    spec = StrategySpec(name="rankdad", options={"rank": 2, "reduce_on_server": True})

    def drop_a_q(content):
        del tensors(content)[next(k for k in tensors(content) if k.endswith(":Q"))]

    # Without agreement weights: they may give the broken upload weight 0 before it reaches the
    # aggregation, and this test is about the message check behind them.
    bounds = flower.ServerBounds(agreement=False)
    with pytest.raises(flower.FlowerRunError) as raised:
        run_direct(tmp_path, small_config(spec, sites=3), spec, HostileGrid(drop_a_q), bounds)
    assert_refused(raised.value, 1, r"the upload breaks the aggregated message")


def far_out_node_app() -> ClientApp:
    """The ClientApp, but the node at partition index 0 scales its step-1 upload by 10⁶."""

    def step(message: Message, context) -> Message:
        reply = flower.handle_step(message, context)
        header = message.content.config_records[flower.HEADER]
        if (header["step"], header["partition_index"]) == (1, 0) and flower.TENSORS in reply.content.array_records:
            far_out(reply.content)
        return reply

    app = ClientApp()
    app.train("step")(step)
    app.train("phase")(flower.handle_phase)
    return app


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
def test_a_far_out_node_stops_a_real_flower_simulation(tmp_path):
    """The same refusal through Flower's simulation engine (Ray actors run the nodes)."""
    ray = pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install 'flwr[simulation]'")
    from flwr.simulation import run_simulation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    spec = StrategySpec(name="dad")
    config = small_config(spec, sites=3)
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        apps = flower.make_flower_apps(config, spec, metrics)
        backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1, "num_gpus": 0}}
        with pytest.raises(flower.FlowerRunError) as raised:
            run_simulation(apps.server_app, far_out_node_app(), num_supernodes=3, backend_config=backend)
    text = str(raised.value)
    assert text.startswith("step 1 phase 0: node ") and "refused: contribution out of bounds" in text, text
    assert apps.summary is None


def test_arrays_decode_as_numpy_reads_them_in_either_memory_order():
    """The bounded reader gives what ``np.load`` gives, for C- and Fortran-ordered arrays."""
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for array in (values, np.asfortranarray(values), values.transpose(2, 0, 1)):
        decoded = flower.records._decode_array("layer:A", Array(array), {flower.NUMPY_DTYPES[np.dtype(np.float32)]})
        assert decoded.numpy().tobytes() == Array(array).numpy().tobytes()
        assert decoded.shape == array.shape


@pytest.mark.parametrize(
    "shape, carried, reason",
    [
        ((3,), 2, r"shape \(3,\) needs 12 bytes, it carries 8"),
        ((1,) * 9, 1, r"invalid shape \(1, 1, 1, 1, 1, 1, 1, 1, 1\): at most 8 dimensions"),
        ((-2,), 0, r"invalid shape \(-2,\): at most 8 dimensions, none negative"),
    ],
    ids=["bytes", "dimensions", "negative"],
)
def test_the_npy_reader_refuses_a_tensor_in_the_words_of_the_grpc_codec(shape, carried, reason):
    """One check (``codec.check_extent``) for both readers of another party's tensors: an .npy
    header and a gRPC payload header declaring the same shape over the same bytes are refused alike."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    array = Array(dtype="float32", shape=(carried,), stype="numpy.ndarray", data=buffer.getvalue() + bytes(4 * carried))
    with pytest.raises(flower.Refused) as npy:
        flower.read_tensors({"x:grad": array}, lambda key: {torch.float32}, 1 << 20, "a test limit")
    chunks = [pb.PayloadChunk.FromString(chunk.SerializeToString()) for chunk in encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(carried)}))]
    meta = chunks[0].header.tensors[0]
    del meta.shape[:]
    meta.shape.extend(shape)
    with pytest.raises(WireError) as wire:
        decode_chunks(chunks)
    assert re.fullmatch(rf"tensor 'x:grad': {reason}.*", str(npy.value)), npy.value
    assert str(npy.value) == str(wire.value)


def test_a_diverging_model_stops_the_run_naming_no_node(tmp_path, task_identity):
    """lr 1e18: every node's loss overflows at step 1 on the server's own (finite) weights; the
    run stops saying the model is at fault, with no node refused (``screening.model_fault``)."""
    from dadfl.replica import OptimizerConfig

    spec = StrategySpec(name="dsgd")
    config = small_config(spec, sites=3).model_copy(update={"optimizer": OptimizerConfig(name="sgd", lr=1e18, momentum=0.0)})
    with pytest.raises(flower.FlowerRunError) as raised:
        run_direct(tmp_path, config, spec, DirectGrid(3))
    text = str(raised.value)
    assert text.startswith("step 1 phase 0: 3 of 3 sites computed non-finite values"), text
    assert "no site is refused" in text and "refused:" not in text and "\n" not in text, text
