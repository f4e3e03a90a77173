"""docker-compose.yml, run without Docker: every service's command line as a local process.

The compose file is parsed; each service runs its own ``command`` in a folder standing
for the container's ``working_dir``, with its volumes mapped to folders (bind mounts are
copied, named volumes shared), in ``depends_on`` order. The only change: the coordinator
listens on, and the sites dial, a free loopback port instead of ``coordinator:50051``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dadfl.metrics import read_metrics
from tests.helpers.network import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def order(services: dict) -> list[str]:
    done: list[str] = []

    def visit(name: str) -> None:
        if name not in done:
            for dependency in services[name].get("depends_on", []):
                visit(dependency)
            done.append(name)

    for name in services:
        visit(name)
    return done


def one_shot(services: dict, name: str) -> bool:
    """A service others wait to *complete* (condition: service_completed_successfully)."""
    for other in services.values():
        depends = other.get("depends_on", [])
        if isinstance(depends, dict) and depends.get(name, {}).get("condition") == "service_completed_successfully":
            return True
    return False


def as_local(command: list[str]) -> list[str]:
    assert command[0] == "dadfl", f"compose commands run the dadfl CLI, got {command}"
    return [sys.executable, "-m", "dadfl.cli", *command[1:]]


def prepare_folder(tmp: Path, service: dict) -> Path:
    work = tmp / "app"
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        inside = work / Path(target).relative_to(service["working_dir"])
        if source.startswith("./") and not inside.exists():
            shutil.copytree(ROOT / source, inside)
        inside.mkdir(parents=True, exist_ok=True)
    return work


def loopback(work: Path, port: int) -> None:
    """The one change: `coordinator:50051` (and the 0.0.0.0 listener) become 127.0.0.1:port."""
    for config in (work / "configs" / "compose").glob("*.toml"):
        text = config.read_text()
        config.write_text(text.replace("coordinator:50051", f"127.0.0.1:{port}").replace("0.0.0.0:50051", f"127.0.0.1:{port}"))


def test_compose_file_has_a_coordinator_and_four_sites():
    services = COMPOSE["services"]
    assert "coordinator" in services
    assert sorted(name for name in services if name.startswith("site-")) == ["site-1", "site-2", "site-3", "site-4"]
    for name in order(services):
        assert (ROOT / "Dockerfile").exists() and services[name]["build"]["context"] == "."


def test_images_choose_base_and_torch_build_and_the_port_stays_local():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.index("ARG BASE_IMAGE") < dockerfile.index("FROM ${BASE_IMAGE}")
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in dockerfile
    services = COMPOSE["services"]
    assert set(services["coordinator"]["build"]["args"]) == {"BASE_IMAGE", "TORCH_INDEX_URL"}
    published = [port for service in services.values() for port in service.get("ports", [])]
    assert published and all(port.startswith("127.0.0.1:") for port in published)


@pytest.mark.slow
@pytest.mark.network
def test_every_compose_service_runs_as_a_process_and_the_federation_trains(tmp_path):
    services, port = COMPOSE["services"], free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    running: dict[str, subprocess.Popen] = {}
    work = None
    try:
        for name in order(services):
            service = services[name]
            work = prepare_folder(tmp_path, service)
            loopback(work, port)
            log = (tmp_path / f"{name}.log").open("w")
            process = subprocess.Popen(as_local(service["command"]), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
            if one_shot(services, name):
                assert process.wait(120) == 0, (tmp_path / f"{name}.log").read_text()
            else:
                running[name] = process
        for name, process in running.items():
            code = process.wait(180)
            assert code == 0, f"{name} exited with {code}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
    records = list(read_metrics(work / "state" / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(100))
    assert all(r["sites"] == 4 for r in records)
    assert records[-1]["test_accuracy"] > 0.8
    assert sum(r["train_loss"] for r in records[-10:]) < sum(r["train_loss"] for r in records[:10]) / 2
    assert (work / "state" / "run" / "model.pt").exists()
