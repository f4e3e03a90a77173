"""Fuzzing an enrolled site's uploads and protocol against a real coordinator (a benchmark, not a test).

    python -m bench.bench_fuzz [--cases 300] [--budget-s 90] [--strategy dad] [--seed 0]

A coordinator process and two honest site processes (``dadfl server`` / ``dadfl site``,
plain text on loopback) train the digits MLP; a third, enrolled site runs in this process
with the real site code, except that each of its steps carries one fuzz case:

- mutations of its genuine upload: bit flips in the tensor bytes, random bytes, tensors
  scaled by 1e6, truncation (a short last chunk marked last), chunks reordered, header
  fields changed (step, phase, attempt, num_samples, loss_sum, total_bytes, a tensor's
  shape, dtype, codec, offset or byte count), an oversize declared payload, a chunk over
  gRPC's message limit;
- protocol abuse: a sync-request flood at step begin, a chunk flood before admission,
  garbage bytes as the first message, a 1 MiB hello.

Every refused case ends the fuzzing site's stream; it reconnects at once and the next
case runs. An accepted case that stops the run (the coordinator gives up) is counted in
``runs_stopped`` and a fresh federation takes the remaining cases. Reported: cases run and by outcome (refused with which status, accepted),
crashes (a process that died unexpectedly or logged a traceback), accepted uploads whose
decoded tensors differ from the genuine ones (``accepted_mutated``), those among them
whose difference exceeds the coordinator's influence bound (``accepted_beyond_influence_bound``:
||mutated - genuine|| > 10 × ||genuine|| over the upload's tensors, a proxy for the
contribution norm the coordinator bounds; header lies that decode unchanged count when
accepted), peak coordinator RSS, and
the last run's final model against a clean run of the two honest sites alone (test
accuracy, max abs weight difference). ``--cases`` and ``--budget-s`` bound the fuzzing; the default
run takes about two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

import dadfl.client.site as site_module
from dadfl.client.config import SiteConfig
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.protos.codec import decode_chunks, encode_payload
from dadfl.server.enrol import enroll
from dadfl.strategies import Payload

from .coordinator_process import rss_kib, start_coordinator, write_server_toml

FUZZER = "fuzzer"
HONEST = ("honest-0", "honest-1")
CHUNK_BYTES = 2048  # the fuzzer's uploads in several chunks, so there is something to reorder
MIB = 1 << 20
INFLUENCE_RATIO = 100.0  # the coordinator's default federation.max_influence_ratio
STALL_S = 30.0  # no committed step for this long: the run is stopped and counted as stalled


# ---------------------------------------------------------------- mutations of genuine uploads


def flip_bits(chunks, rng):
    for _ in range(rng.randint(1, 8)):
        chunk = rng.choice(chunks)
        if chunk.data:
            data = bytearray(chunk.data)
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
            chunk.data = bytes(data)
    return chunks


def random_bytes(chunks, rng):
    chunk = rng.choice(chunks)
    chunk.data = rng.randbytes(len(chunk.data))
    return chunks


def truncate(chunks, rng):
    cut = chunks[: rng.randint(1, len(chunks))]
    cut[-1].data = cut[-1].data[: rng.randrange(max(len(cut[-1].data), 1))]
    cut[-1].last = True
    return cut


def reorder(chunks, rng):
    if len(chunks) > 2:
        i, j = rng.sample(range(1, len(chunks)), 2)
        chunks[i], chunks[j] = chunks[j], chunks[i]
    else:
        chunks.reverse()
    return chunks


def header_field(chunks, rng):
    header = chunks[0].header
    meta = rng.choice(header.tensors)
    change = rng.choice(["step", "phase", "attempt", "num_samples", "loss_nan", "loss_negative", "loss_huge", "total_bytes",
                         "shape", "dtype", "codec", "offset", "nbytes", "fingerprint"])
    if change == "step":
        header.step += rng.choice([-1, 1, 1 << 40])
    elif change == "phase":
        header.phase += rng.randint(1, 3)
    elif change == "attempt":
        header.attempt += 1
    elif change == "num_samples":
        header.num_samples = rng.choice([0, 1, header.num_samples * 7, 1 << 60])
    elif change == "loss_nan":
        header.loss_sum = math.nan
    elif change == "loss_negative":
        header.loss_sum = -abs(header.loss_sum) - 1
    elif change == "loss_huge":
        header.loss_sum = 1e300
    elif change == "total_bytes":
        header.total_bytes += rng.choice([-4, 4])
    elif change == "shape" and meta.shape:
        i = rng.randrange(len(meta.shape))
        meta.shape[i] = rng.choice([0, meta.shape[i] + 1, 1 << 40])
    elif change == "dtype":
        meta.dtype = rng.choice([pb.FLOAT64, pb.FLOAT16, pb.INT32, 99])
    elif change == "codec":
        meta.codec = rng.choice([pb.FP16, pb.BF16, 7])
    elif change == "offset":
        meta.offset += 4
    elif change == "nbytes":
        meta.nbytes += rng.choice([-4, 4])
    else:
        header.base_fingerprint = "f" * 64
    return chunks


def oversize_declared(chunks, rng):
    chunks[0].header.total_bytes = 1 << 40
    return chunks


def oversize_message(chunks, rng):
    chunks[0].data = bytes(6 * MIB)
    return chunks


MUTATIONS = {
    "bit_flip": flip_bits,
    "random_bytes": random_bytes,
    "truncate": truncate,
    "reorder": reorder,
    "header_field": header_field,
    "oversize_declared": oversize_declared,
    "oversize_message": oversize_message,
    "scale_1e6": None,  # on the tensors, before encoding
}
ABUSE = ("sync_flood", "preadmission_flood", "garbage_first_message", "huge_hello")
ON_CONNECT = ("preadmission_flood", "garbage_first_message", "huge_hello")  # cases that need a fresh stream


def decoded_difference(genuine: Payload, chunks) -> float | None:
    """||mutated - genuine|| / ||genuine|| over all tensors of a mutated upload that still
    decodes to the same keys and shapes (None when it does not, 0.0 when it decodes to the
    genuine one, inf when a value is not finite)."""
    try:
        mutated = decode_chunks(chunks).payload
    except Exception:
        return None
    diff_sq = norm_sq = 0.0
    for key, tensor in genuine.tensors.items():
        other = mutated.tensors.get(key)
        if other is None or other.shape != tensor.shape:
            return None
        diff_sq += (other.double() - tensor.double()).square().sum().item()
        norm_sq += tensor.double().square().sum().item()
    if not math.isfinite(diff_sq):
        return math.inf
    return math.sqrt(diff_sq / max(norm_sq, 1e-24))


# ---------------------------------------------------------------- the fuzzing site


class Fuzzer:
    """Picks the cases and records what happened to each."""

    def __init__(self, cases: int, budget_s: float, seed: int):
        self.rng = random.Random(seed)
        self.limit, self.budget_s = cases, budget_s
        self.deadline = math.inf  # set when the fuzzing site starts
        self.kinds = list(MUTATIONS) + list(ABUSE)
        self.cases: list[dict] = []
        self.current: dict | None = None
        self.server_gone = threading.Event()

    def budget_left(self) -> bool:
        return len(self.cases) < self.limit and time.monotonic() < self.deadline

    def more(self) -> bool:
        return self.budget_left() and not self.server_gone.is_set()

    def start(self, mid_stream: bool = False) -> dict | None:
        self.current = None
        if not self.more():
            return None
        kinds = [k for k in self.kinds if k not in ON_CONNECT] if mid_stream else self.kinds
        self.current = {"kind": self.rng.choice(kinds), "outcome": "pending"}
        self.cases.append(self.current)
        return self.current

    def refused(self, code: str) -> None:
        if self.current is not None and self.current["outcome"] == "pending":
            self.current["outcome"] = code
        self.current = None


class FuzzSession(site_module.Session):
    fuzzer: Fuzzer

    def handle(self, message):
        case = self.fuzzer.current
        finished = super().handle(message)
        if message.WhichOneof("kind") == "config" and case is not None and case["kind"] == "preadmission_flood":
            chunk = pb.PayloadChunk(data=bytes(MIB))
            for _ in range(32):
                self.send(chunk=chunk)
        return finished

    def on_step_begin(self, begin):
        case = self.fuzzer.current
        if case is not None and case["kind"] == "sync_flood" and case["outcome"] == "pending":
            for _ in range(500):
                self.send(sync_request=cpb.SyncRequest(step=begin.step, fingerprint="0" * 64))
        super().on_step_begin(begin)

    def upload(self, payload, loss_sum=0.0):
        case = self.fuzzer.current
        if case is None or case["kind"] not in MUTATIONS or case.get("step") is not None:
            return super().upload(payload, loss_sum)
        run = self.site.run
        genuine = payload
        if case["kind"] == "scale_1e6":
            payload = Payload(payload.step, payload.phase, payload.num_samples, {k: v * 1e6 for k, v in payload.tensors.items()})
        chunks = encode_payload(payload, run.codec, CHUNK_BYTES, kind=pb.PHASE, attempt=self.step.attempt,
                                loss_sum=loss_sum, base_fingerprint=self.step.fingerprint)
        mutate = MUTATIONS[case["kind"]]
        if mutate is not None:
            chunks = mutate(chunks, self.fuzzer.rng)
        case.update(step=self.step.step, attempt=self.step.attempt, phase=payload.phase,
                    difference=decoded_difference(genuine, [pb.PayloadChunk.FromString(c.SerializeToString()) for c in chunks]))
        for chunk in chunks:
            self.send(chunk=chunk)

    def on_message(self, message):
        super().on_message(message)
        case = self.fuzzer.current
        if case is not None and case.get("step") is not None and self.step is None:
            case["outcome"] = "completed step"  # the server answered: the next step carries the next case
            self.fuzzer.start(mid_stream=True)


def raw_case(endpoint: str, kind: str, token: str) -> str:
    """Garbage as the first message, or a 1 MiB hello; the status the server ended with."""
    channel = grpc.insecure_channel(endpoint, options=channel_options(4 * MIB))
    join = channel.stream_stream("/dadfl.v1.Coordinator/Join", request_serializer=lambda raw: raw,
                                 response_deserializer=cpb.ServerMessage.FromString)
    message = (random.randbytes(256) if kind == "garbage_first_message"
               else cpb.SiteMessage(hello=cpb.Hello(site_id="x" * MIB, token=token, protocol_version=PROTOCOL_VERSION)).SerializeToString())
    try:
        for _ in join(iter([message]), timeout=20):
            pass
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()


def run_fuzzer(fuzzer: Fuzzer, config: SiteConfig) -> None:
    site_module.Session = FuzzSession
    FuzzSession.fuzzer = fuzzer
    site = site_module.Site(config)
    if fuzzer.deadline == math.inf:
        fuzzer.deadline = time.monotonic() + fuzzer.budget_s
    fuzzer.server_gone.clear()
    fuzzer.start()
    while fuzzer.current is not None:
        case = fuzzer.current
        if case["kind"] in ("garbage_first_message", "huge_hello"):
            fuzzer.refused(raw_case(config.connect.server, case["kind"], config.token))
            fuzzer.start()
            continue
        try:
            if asyncio.run(site.join(insecure=True)):
                fuzzer.refused("run finished")
                return
            fuzzer.refused("stream ended")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # no answer from the server: not an outcome, try the case again
                if case.get("step") is None and case["outcome"] == "pending" and not fuzzer.server_gone.is_set():
                    time.sleep(0.2)
                    continue
            fuzzer.refused(exc.code().name)
        fuzzer.start()


# ---------------------------------------------------------------- the federation


def write_configs(tmp: Path, steps: int, strategy: str, max_update_norm: float | None) -> Path:
    federation = {"min_sites": 2, "initial_sites": 2, "phase_timeout_s": 5, "quorum_timeout_s": 120, "linger_s": 2,
                  "quarantine_after": 1_000_000}  # keep fuzzing: every case is one refusal
    if max_update_norm:
        federation["max_update_norm"] = max_update_norm
    return write_server_toml(tmp, steps, strategy, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, federation=federation)


def site_toml(tmp: Path, site_id: str, endpoint: str, index: int) -> Path:
    path = tmp / f"{site_id}.toml"
    path.write_text(f"""\
site_id = "{site_id}"
token = "{enroll(tmp / 'tokens.json', site_id, replace=True)}"
device = "cpu"
threads = 1
[connect]
server = "{endpoint}"
[data]
source = "partition"
site_index = {index}
num_sites = 3
""")
    return path


def federation(tmp: Path, steps: int, strategy: str, fuzzer: Fuzzer | None, max_update_norm: float | None = None) -> dict:
    """Run the coordinator and the honest sites (and the fuzzer); what they did."""
    config = write_configs(tmp, steps, strategy, max_update_norm)
    for name in HONEST:  # the coordinator refuses to start without a tokens file
        enroll(tmp / "tokens.json", name, replace=True)
    server, endpoint = start_coordinator(tmp, config)
    honest = [subprocess.Popen([sys.executable, "-m", "dadfl.cli", "site", "--config", str(site_toml(tmp, name, endpoint, i)), "--insecure"],
                               stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "w")) for i, name in enumerate(HONEST)]
    try:
        return watch(tmp, server, honest, fuzzer, endpoint, steps)
    finally:
        for process in (server, *honest):
            if process.poll() is None:
                process.kill()


def watch(tmp: Path, server: subprocess.Popen, honest: list, fuzzer: Fuzzer | None, endpoint: str, steps: int) -> dict:
    peak = 0.0
    thread = None
    if fuzzer:
        fuzz_config = SiteConfig.model_validate({
            "site_id": FUZZER, "token": enroll(tmp / "tokens.json", FUZZER, replace=True), "device": "cpu", "threads": 1,
            "connect": {"server": endpoint}, "data": {"source": "partition", "site_index": 2, "num_sites": 3},
        })
        thread = threading.Thread(target=run_fuzzer, args=(fuzzer, fuzz_config), daemon=True)
        thread.start()
    metrics_file, progress, stalled = tmp / "run" / "metrics.jsonl", (-1, time.monotonic()), False
    while server.poll() is None:
        try:
            peak = max(peak, rss_kib(server.pid)["VmHWM"] / 1024)
        except ProcessLookupError:
            break
        size = metrics_file.stat().st_size if metrics_file.exists() else 0
        if size != progress[0]:
            progress = (size, time.monotonic())
        elif time.monotonic() - progress[1] > STALL_S:  # e.g. a poisoned model every site now refuses to train on
            stalled = True
            server.kill()
        time.sleep(0.2)
    server.wait()
    if fuzzer:
        fuzzer.server_gone.set()
    honest_rc = []
    for process in honest:
        try:
            honest_rc.append(process.wait(10))
        except subprocess.TimeoutExpired:  # sites retry a server that stopped without finishing the run
            process.kill()
            honest_rc.append("killed: still reconnecting 10 s after the server exited")
    if thread:
        thread.join(30)
    logs = [tmp / "server.log", *(tmp / f"{name}.log" for name in HONEST)]
    tracebacks = [path.name for path in logs if "Traceback" in path.read_text()]
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()] if (tmp / "run" / "metrics.jsonl").exists() else []
    model = torch.load(tmp / "run" / "model.pt", weights_only=True) if (tmp / "run" / "model.pt").exists() else None
    last = records[-1] if records else {}
    accuracy = next((v for k, v in last.items() if k.startswith("test_") and k != "test_loss"), None)
    return {"server_rc": server.returncode, "honest_rc": honest_rc, "tracebacks": tracebacks, "completed": len(records) == steps,
            "run_stopped": stalled or "run stopped:" in (tmp / "server.log").read_text(), "stalled": stalled, "records": records, "model": model, "accuracy": accuracy, "peak_rss_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--budget-s", type=float, default=90.0, help="fuzzing time budget (the clean run comes on top)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 3 per case, at least 200)")
    parser.add_argument("--strategy", default="dad")
    parser.add_argument("--max-update-norm", type=float, default=None,
                        help="the coordinator's federation.max_update_norm: the only size bound when 2 sites take part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    parser.add_argument("--no-clean", dest="clean", action="store_false", help="skip the clean run (smoke tests)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders (logs, metrics, models) here")
    args = parser.parse_args()
    steps = args.steps or max(200, 3 * args.cases)
    torch.manual_seed(args.seed)
    fuzzer = Fuzzer(args.cases, args.budget_s, args.seed)
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        root = args.keep or Path(folder)
        while not runs or (not runs[-1]["completed"] and fuzzer.budget_left()):  # a run the fuzzer stopped: start a new one
            tmp = root / f"fuzzed-{len(runs)}"
            tmp.mkdir(parents=True, exist_ok=True)
            first_case = len(fuzzer.cases)
            runs.append(federation(tmp, steps, args.strategy, fuzzer, args.max_update_norm))
            runs[-1]["cases"] = fuzzer.cases[first_case:]
        fuzz_seconds = time.monotonic() - started
        fuzzed = runs[-1]
        (root / "clean").mkdir(parents=True, exist_ok=True)
        clean = federation(root / "clean", steps, args.strategy, None, args.max_update_norm) if args.clean else {"model": None, "accuracy": None}
    cases, accepted = [], []
    for run in runs:
        committed = {(r["step"], r["attempt"]): r["site_ids"] for r in run["records"]}
        done = [c for c in run["cases"] if c["outcome"] != "pending" or c.get("step") is not None]
        cases += done
        accepted += [c for c in done if c["outcome"] == "completed step" and FUZZER in committed.get((c["step"], c["attempt"]), ())]
    # a changed header that decodes to the genuine tensors is a lie (loss, sample count) when accepted
    accepted_mutated = [c for c in accepted if c["kind"] in MUTATIONS and (c.get("difference") != 0.0 or c["kind"] == "header_field")]
    beyond_bound = [c for c in accepted_mutated if c.get("difference") is None or c["difference"] > INFLUENCE_RATIO]
    outcomes = collections.Counter(("accepted" if c in accepted else c["outcome"]) for c in cases)
    by_kind = collections.defaultdict(collections.Counter)
    for c in cases:
        by_kind[c["kind"]]["accepted" if c in accepted else c["outcome"]] += 1
    diff = None
    if fuzzed["model"] is not None and clean["model"] is not None:
        diff = max((fuzzed["model"][k].double() - clean["model"][k].double()).abs().max().item() for k in clean["model"])
    # a crash: a process that died unexpectedly or logged a traceback; an orderly "run stopped" is reported apart
    crashes = sum(int(run["server_rc"] not in (0, 1) and not run["stalled"]) + len(run["tracebacks"]) for run in runs)
    crashes += sum(rc not in (0, 1) and not str(rc).startswith("killed") for run in runs for rc in run["honest_rc"])
    figures = {
        "cases": len(cases),
        "strategy": args.strategy,
        "max_update_norm": args.max_update_norm,
        "steps": steps,
        "outcomes": dict(outcomes),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "crashes": crashes,
        "runs": len(runs),
        "runs_stopped": sum(run["run_stopped"] for run in runs),
        "runs_stalled": sum(run["stalled"] for run in runs),
        "last_run_completed": fuzzed["completed"],
        "server_rc": [run["server_rc"] for run in runs],
        "honest_rc": [run["honest_rc"] for run in runs],
        "tracebacks_in": sorted({name for run in runs for name in run["tracebacks"]}),
        "accepted_mutated": len(accepted_mutated),
        "accepted_mutated_kinds": dict(collections.Counter(c["kind"] for c in accepted_mutated)),
        "accepted_beyond_influence_bound": len(beyond_bound),
        "largest_accepted_norm_ratio": max((c["difference"] or 0.0 for c in accepted_mutated), default=0.0),
        "peak_coordinator_rss_mib": round(max(run["peak_rss_mib"] for run in runs), 1),
        "steps_done": [len(run["records"]) for run in runs],
        "accuracy_fuzzed": fuzzed["accuracy"],
        "accuracy_clean": clean["accuracy"],
        "max_abs_weight_diff_vs_clean": diff,
        "fuzz_seconds": round(fuzz_seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
    }
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
