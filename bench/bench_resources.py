"""What a hostile enrolled site can make the coordinator hold (a benchmark, not a test).

    python -m bench.bench_resources [--flood-mib 216] [--sync-requests 20000]

Runs a real coordinator as a subprocess (plain text on loopback) and reports:

- **pre-admission flood**: an enrolled site completes the handshake (hello, ready) while
  the server waits for a second site, then sends ``--flood-mib`` MiB of well-formed
  payload chunks before it was admitted. Coordinator RSS before, its peak (VmHWM), and
  after the flooding stream ended, plus the status the flood got.
- **sync flood**: an honest site process and an enrolled site that answers one
  step_begin with ``--sync-requests`` sync requests; how many full states the server
  resent, the status the flooder got, the slowest step, and whether the run finished.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.protos.codec import encode_payload
from dadfl.server.enrol import enroll
from dadfl.strategies import Payload

from .coordinator_process import rss_kib, start_coordinator, write_server_toml

MIB = 1 << 20


def start_server(tmp: Path, steps: int, min_sites: int, initial_sites: int) -> tuple[subprocess.Popen, str]:
    config = write_server_toml(tmp, steps, federation={
        "min_sites": min_sites, "initial_sites": initial_sites, "phase_timeout_s": 20, "quorum_timeout_s": 120, "linger_s": 1,
    })
    return start_coordinator(tmp, config)


class RawSite:
    """A hand-driven Join stream: send what you like, read what the server answers."""

    def __init__(self, endpoint: str, site_id: str, token: str):
        self.outgoing: queue.Queue = queue.Queue()
        self.channel = grpc.insecure_channel(endpoint, options=channel_options(4 * MIB))
        self.responses = cpb_grpc.CoordinatorStub(self.channel).Join(iter(self.outgoing.get, None))
        self.send(hello=cpb.Hello(site_id=site_id, token=token, protocol_version=PROTOCOL_VERSION))

    def send(self, **kind) -> None:
        self.outgoing.put(cpb.SiteMessage(**kind))

    def next(self) -> cpb.ServerMessage:
        return next(self.responses)

    def status(self, timeout: float = 60) -> str:
        """Drain the stream; the status code it ended with."""
        self.outgoing.put(None)
        deadline = time.monotonic() + timeout
        try:
            for _ in self.responses:
                if time.monotonic() > deadline:
                    return "still open"
            return "OK"
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()[:120]}"
        finally:
            self.channel.close()


def flood_chunks(payload_mib: int) -> list[pb.PayloadChunk]:
    payload = Payload(0, 0, 16, {"0.weight:grad": torch.zeros(payload_mib * MIB // 4)})
    return encode_payload(payload, chunk_bytes=MIB, kind=pb.PHASE)


def refused_stream(endpoint: str, site_id: str, token: str, chunks: list[pb.PayloadChunk], repeats: int) -> str:
    """Hello, ready, then ``repeats`` × ``chunks`` before admission; the status it ends with."""
    site = RawSite(endpoint, site_id, token)
    config = site.next().config
    site.send(ready=cpb.Ready(layout_fingerprint=config.layout_fingerprint))
    for _ in range(repeats):
        for chunk in chunks:
            site.send(chunk=chunk)
    return site.status()


def preadmission_flood(flood_mib: int) -> dict:
    """The flood's own cost: the baseline is read after a control site went through the same
    refusal with one chunk, so what one refused stream costs once (gRPC's threads and buffers,
    the first config) is not counted as the flood's."""
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        control_token = enroll(tmp / "tokens.json", "control")
        token = enroll(tmp / "tokens.json", "flooder")
        server, endpoint = start_server(tmp, steps=5, min_sites=1, initial_sites=2)
        try:
            chunks = flood_chunks(8)
            control_status = refused_stream(endpoint, "control", control_token, chunks[:1], 1)
            time.sleep(1.0)
            before = rss_kib(server.pid)
            started = time.monotonic()
            status = refused_stream(endpoint, "flooder", token, chunks, flood_mib // 8)
            flood_s = time.monotonic() - started
            time.sleep(2.0)
            after = rss_kib(server.pid)
        finally:
            server.kill()
            server.wait()
    return {
        "scenario": "pre-admission flood",
        "flood_mib": flood_mib // 8 * 8,
        "control_status": control_status,
        "status": status,
        "rss_before_mib": round(before["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(after["VmHWM"] / 1024, 1),
        "rss_after_mib": round(after["VmRSS"] / 1024, 1),
        "growth_after_mib": round((after["VmRSS"] - before["VmRSS"]) / 1024, 1),
        "seconds": round(flood_s, 1),
    }


def sync_flood(requests: int, steps: int = 200) -> dict:
    import dadfl.client.site as site_module
    from dadfl.client.config import SiteConfig

    class Flooder(site_module.Session):
        flooded = False

        def on_step_begin(self, begin):
            if begin.step == 5 and not Flooder.flooded:
                Flooder.flooded = True
                for _ in range(requests):
                    self.send(sync_request=cpb.SyncRequest(step=begin.step, fingerprint="0" * 64))
            super().on_step_begin(begin)

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        site_file = tmp / "honest.toml"
        site_file.write_text(f"""\
site_id = "honest"
token = "{enroll(tmp / 'tokens.json', 'honest')}"
device = "cpu"
threads = 1
[connect]
server = "ENDPOINT"
[data]
source = "partition"
site_index = 0
num_sites = 2
""")
        token = enroll(tmp / "tokens.json", "flooder")
        server, endpoint = start_server(tmp, steps=steps, min_sites=1, initial_sites=2)
        site_file.write_text(site_file.read_text().replace("ENDPOINT", endpoint))
        honest = subprocess.Popen([sys.executable, "-m", "dadfl.cli", "site", "--config", str(site_file), "--insecure"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        site_module.Session, original = Flooder, site_module.Session
        config = SiteConfig.model_validate({
            "site_id": "flooder", "token": token, "device": "cpu", "threads": 1,
            "connect": {"server": endpoint, "backoff_initial_s": 0.2, "max_attempts": 10},
            "data": {"source": "partition", "site_index": 1, "num_sites": 2},
        })
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(summary=run_flooder(site_module, config)), daemon=True)
        try:
            started = time.monotonic()
            thread.start()
            server.wait(300)
            seconds = time.monotonic() - started
            thread.join(30)
            honest_rc = honest.wait(60)
        finally:
            site_module.Session = original
            for process in (server, honest):
                if process.poll() is None:
                    process.kill()
        log = (tmp / "server.log").read_text()
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = outcome.get("summary")
    return {
        "scenario": "sync flood",
        "sync_requests": requests,
        "state_resends": log.count("flooder has weights"),
        "flooder_dropped": log.count("closing site flooder"),
        "flooder": summary if isinstance(summary, str) else f"{summary.steps} steps, {summary.connections} connections",
        "server_exit": server.returncode,
        "honest_exit": honest_rc,
        "steps_done": len(records),
        "slowest_step_s": round(max(r["seconds"] for r in records), 3),
        "median_step_s": round(sorted(r["seconds"] for r in records)[len(records) // 2], 4),
        "run_seconds": round(seconds, 1),
    }


def run_flooder(site_module, config):
    try:
        return site_module.run_site(config, insecure=True)
    except Exception as exc:  # reported, not raised: the figures are what matter
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood-mib", type=int, default=216)
    parser.add_argument("--sync-requests", type=int, default=20_000)
    parser.add_argument("--only", choices=("preadmission", "sync"))
    args = parser.parse_args()
    if args.only in (None, "preadmission"):
        print(json.dumps(preadmission_flood(args.flood_mib)))
    if args.only in (None, "sync"):
        print(json.dumps(sync_flood(args.sync_requests)))


if __name__ == "__main__":
    main()
