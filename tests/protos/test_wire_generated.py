"""The committed protobuf modules are exactly what the generator makes from the .proto files."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (a test dependency) regenerates the protos")

from dadfl.protos import generate  # noqa: E402


def test_regenerating_the_protos_changes_nothing(tmp_path):
    written = generate.generate(tmp_path)
    assert {p.name for p in written} >= {"coordinator_pb2.py", "coordinator_pb2_grpc.py", "tensor_pb2.py"}
    for path in written:
        committed = generate.PROTOS_DIR / path.name
        assert committed.exists(), f"{committed.name} is not committed: run python -m dadfl.protos.generate"
        assert committed.read_bytes() == path.read_bytes(), f"{committed.name} is stale: run python -m dadfl.protos.generate"


def test_generated_modules_import_inside_the_package():
    from dadfl.protos import coordinator_pb2, coordinator_pb2_grpc

    assert coordinator_pb2.DESCRIPTOR.package == "dadfl.v1"
    assert hasattr(coordinator_pb2_grpc, "CoordinatorStub")
    assert Path(coordinator_pb2.__file__).parent == generate.PROTOS_DIR
