"""Payload encode + decode throughput of the wire codec (a benchmark, not a test).

    python bench/bench_codec.py [--sizes-mb 1 16 128] [--repeats 5]

For each payload size and codec (raw float32, fp16, bf16 factors) it times
``encode_payload`` (Payload -> chunk messages) and decoding (chunks -> Payload), and the
same with protobuf serialisation (what gRPC adds on the wire). Throughput is payload
bytes (float32 size) per second of encode + decode, the median of ``--repeats``.
Goal: >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import codec_id, decode_chunks, encode_payload
from dadfl.strategies import Payload

GOAL_GBPS = 1.0


def factor_payload(total_bytes: int) -> Payload:
    """Activation and delta factors of 4 layers, plus a dense bias: a typical dAD upload."""
    per_tensor = total_bytes // 8 // 4
    rows = 256
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(4):
        width = max(per_tensor // rows, 1)
        tensors[f"{layer}:A"] = torch.randn(1, rows, width, generator=g)
        tensors[f"{layer}:D"] = torch.randn(1, rows, width, generator=g)
    tensors["out.bias:grad"] = torch.randn(10, generator=g)
    return Payload(0, 0, rows, tensors)


def time_once(payload: Payload, codec: int, serialise: bool) -> tuple[float, float]:
    start = time.perf_counter()
    chunks = encode_payload(payload, codec)
    wire = [c.SerializeToString() for c in chunks] if serialise else chunks
    middle = time.perf_counter()
    received = [pb.PayloadChunk.FromString(w) for w in wire] if serialise else wire
    decode_chunks(received)
    return middle - start, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'size':>7} {'codec':>5} {'serialised':>10} {'encode ms':>10} {'decode ms':>10} {'GB/s':>7} {'vs goal':>8}")
    for size_mb in args.sizes_mb:
        payload = factor_payload(size_mb << 20)
        nbytes = payload.nbytes()
        for name in ("none", "fp16", "bf16"):
            for serialise in (False, True):
                time_once(payload, codec_id(name), serialise)  # warm up allocator and caches
                runs = [time_once(payload, codec_id(name), serialise) for _ in range(args.repeats)]
                encode = statistics.median(r[0] for r in runs)
                decode = statistics.median(r[1] for r in runs)
                gbps = nbytes / (encode + decode) / 1e9
                print(
                    f"{nbytes / 2**20:6.0f}M {name:>5} {str(serialise):>10} {encode * 1e3:10.1f} {decode * 1e3:10.1f} "
                    f"{gbps:7.2f} {gbps / GOAL_GBPS:7.2f}x"
                )


if __name__ == "__main__":
    main()
