"""State files (checkpoints) are written and read a chunk at a time: bit-identical round trip,
no piece bigger than a chunk, reads land in the replica's own tensors, a torn file is refused
before anything is overwritten; and the 100M-parameter setting's size."""

from __future__ import annotations

import io

import pytest
import torch

from dadfl.protos.state import fill_state, state_payload
from dadfl.protos.state_file import fill, verify, write_state
from dadfl.replica import OptimizerConfig, Replica
from dadfl.server import checkpoint
from dadfl.strategies import make_strategy, weights_fingerprint
from dadfl.workloads import load_workload

CHUNK = 1024  # bytes: the larger tensors (6 KB) span several chunks


def trained(seed: int, optimizer: str = "adam") -> Replica:
    """A small transformer replica after two Adam steps: moments and a step counter exist."""
    torch.manual_seed(seed)
    workload = load_workload("char-transformer", seq_len=8, d_model=16, heads=2, layers=1, max_sequences=50)
    replica = Replica(workload, make_strategy("dsgd"), OptimizerConfig(name=optimizer, lr=0.01, momentum=0.0))
    for _ in range(2):
        replica.apply_update({name: torch.randn_like(p, dtype=torch.float64) for name, p in replica.model.named_parameters()})
    return replica


def state_bits(replica: Replica) -> dict[str, bytes]:
    return {key: t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for key, t in state_payload(replica, 0).tensors.items()}


def test_a_checkpoint_round_trips_bit_identically_into_the_replicas_own_tensors(tmp_path):
    source, target = trained(1), trained(2)
    strategy_state = {"error/0": torch.randn(3, 5, dtype=torch.float64)}
    checkpoint.save_checkpoint(tmp_path, source, 7, "run7", {"workload": "w"}, strategy_state, {})
    params_before = [p.data_ptr() for p in target.model.parameters()]
    moments_before = [s["exp_avg"].data_ptr() for s in target.optimizer.state.values()]
    resumed = checkpoint.resume(tmp_path, target, {"workload": "w"})
    assert (resumed.next_step, resumed.run_id) == (7, "run7")
    assert torch.equal(resumed.strategy_state["error/0"], strategy_state["error/0"])
    assert state_bits(target) == state_bits(source)
    assert weights_fingerprint(target.model) == weights_fingerprint(source.model)
    # read into the memory the replica already had: no second copy of weights or moments remains
    assert [p.data_ptr() for p in target.model.parameters()] == params_before
    assert [s["exp_avg"].data_ptr() for s in target.optimizer.state.values()] == moments_before
    # and the resumed replica steps exactly as the source
    update = {name: torch.randn_like(p, dtype=torch.float64) for name, p in source.model.named_parameters()}
    assert source.apply_update(update) == target.apply_update(update)


def test_the_writer_hands_the_file_no_piece_bigger_than_a_chunk():
    replica = trained(1)
    pieces: list[int] = []
    file = io.BytesIO()
    state = state_payload(replica, 3)
    write_state(file, state, b"{}", chunk_bytes=CHUNK, on_piece=pieces.append)
    tensor_bytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
    largest = max(t.numel() * t.element_size() for t in state.tensors.values())
    assert largest > 4 * CHUNK, "the test model must have tensors spanning several chunks"
    header_bytes = sum(pieces[:5])  # magic, meta length, meta, header length, header
    assert max(pieces[5:]) <= CHUNK and sum(pieces[5:]) == tensor_bytes
    assert header_bytes < 128 * len(state.tensors)  # names, shapes, offsets: no tensor data
    file.seek(0)
    meta, header = verify(file, chunk_bytes=CHUNK)
    assert meta == b"{}" and header.total_bytes == tensor_bytes and file.tell() == 0
    read: dict[str, torch.Tensor] = {}
    fill(file, lambda key, shape, dtype: read.setdefault(key, torch.full(shape, 7, dtype=dtype)), chunk_bytes=CHUNK)
    assert read.keys() == state.tensors.keys()
    assert all(torch.equal(read[key].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for key, t in state.tensors.items())


def test_a_torn_or_altered_checkpoint_is_refused_before_anything_is_overwritten(tmp_path):
    source, target = trained(1), trained(2)
    checkpoint.save_checkpoint(tmp_path, source, 7, "run7", {"workload": "w"}, {}, {})
    path = tmp_path / checkpoint.CHECKPOINT
    data = bytearray(path.read_bytes())
    before = state_bits(target)
    for case, broken in {"one bit flipped": data[:-100] + bytes([data[-100] ^ 1]) + data[-99:], "cut short": data[:-1000]}.items():
        path.write_bytes(bytes(broken))
        with pytest.raises(ValueError, match="is not a readable checkpoint") as refused:
            checkpoint.resume(tmp_path, target, {"workload": "w"})
        assert "\n" not in str(refused.value), case
        assert state_bits(target) == before, f"{case}: nothing is overwritten"
    torch.save({"model": source.model.state_dict()}, path)  # how checkpoints were written before this layout
    with pytest.raises(ValueError, match="written by an earlier dadfl with torch.save"):
        checkpoint.resume(tmp_path, target, {"workload": "w"})
    assert state_bits(target) == before


def test_a_state_file_that_does_not_fit_the_replica_is_refused_untouched():
    source = trained(1)
    other = Replica(load_workload("char-transformer", seq_len=8, d_model=32, heads=2, layers=1, max_sequences=50),
                    make_strategy("dsgd"), OptimizerConfig(name="adam", lr=0.01))
    file = io.BytesIO()
    write_state(file, state_payload(source, 0))
    file.seek(0)
    before = weights_fingerprint(other.model)
    with pytest.raises(ValueError, match="does not fit this model"):
        fill_state(other, file, b"dadflst1", "strategy/")
    assert weights_fingerprint(other.model) == before


def test_the_100m_setting_has_about_100m_parameters():
    workload = load_workload("char-transformer-100m")
    assert workload.name == "char-transformer-100m" and workload.options["d_model"] == 768
    with torch.device("meta"):  # no memory, no initialisation
        model = workload.build_model()
    count = sum(p.numel() for p in model.parameters())
    assert 95e6 <= count <= 105e6, count
