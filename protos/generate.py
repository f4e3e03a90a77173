"""``dadfl.protos.generate`` — regenerate the Python modules of the wire schema: ``python -m dadfl.protos.generate``.

The ``.proto`` sources live in ``protos/dadfl/v1/`` (package ``dadfl.v1``); the
generated ``*_pb2.py`` / ``*_pb2_grpc.py`` modules are committed next to this file so
that running dadfl needs only ``grpcio`` and ``protobuf``. ``grpcio-tools`` (a test/dev
dependency) is needed only here. Output is deterministic: ``tests/protos/test_wire_generated.py``
regenerates into a temporary folder and compares byte for byte.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
SOURCES = ("dadfl/v1/tensor.proto", "dadfl/v1/coordinator.proto")


def generate(out_dir: Path = PROTOS_DIR) -> list[Path]:
    """Compile every source into ``out_dir``; return the written modules."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("grpcio-tools is not installed: pip install 'dadfl[test]' to regenerate the protos") from None
    include = Path(protoc.__file__).resolve().parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTOS_DIR}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", *SOURCES]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {', '.join(SOURCES)}")
        for module in sorted((Path(tmp) / "dadfl" / "v1").glob("*.py")):
            target = Path(out_dir) / module.name
            target.write_text(_relative_imports(module.read_text()))
            written.append(target)
    return written


def _relative_imports(code: str) -> str:
    # protoc writes absolute imports ("from dadfl.v1 import tensor_pb2") that would resolve
    # to the top-level dadfl package; the modules live inside dadfl.protos instead.
    return re.sub(r"^from dadfl\.v1 import ", "from . import ", code, flags=re.MULTILINE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTOS_DIR, help="folder for the generated modules")
    options = parser.parse_args(argv)
    for path in generate(options.out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
