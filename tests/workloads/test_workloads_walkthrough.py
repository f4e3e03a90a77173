"""docs/workloads.md run as written: three hospitals with their own CSV files and a model
package outside the project, real processes over TLS, federated evaluation, no data at
the coordinator.

The commands are the ``bash`` blocks of the walkthrough's section, so the page and this
test cannot drift apart. The one change: the port the page picks (``PORT=50051``) becomes
a free one, as a reader would pick on a busy machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dadfl.metrics import read_metrics
from tests.helpers.network import free_port

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "workloads.md"
SITES = {"hospital-a", "hospital-b", "hospital-c"}


def section_commands(title: str) -> str:
    """The ``bash`` blocks of the section headed ``## <title>``, in order."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return "\n".join(re.findall(r"```bash\n(.*?)```", text[start : end if end > 0 else None], re.S))


def run_script(script: str, folder: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the page needs no search-path hack
    process = subprocess.Popen(
        ["bash", "-e", "-c", script], cwd=folder, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the coordinator and sites run in the background
        output, _ = process.communicate()
        pytest.fail(f"the walkthrough did not finish within {timeout:.0f} s:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, output)


@pytest.mark.slow
def test_tabular_walkthrough_runs_as_written(tmp_path):
    script = section_commands("1. Three hospitals with CSV files")
    assert script.count("PORT=50051\n") == 1
    result = run_script(script.replace("PORT=50051\n", f"PORT={free_port()}\n"), tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]

    run = tmp_path / "runs" / "hospitals"
    for site in SITES:  # each hospital allows the federation's own workload, nothing is imported otherwise
        assert '"hospital_models.tabular:mlp"' in (tmp_path / f"{site}.toml").read_text()
    assert "(TLS)" in result.stdout  # the coordinator served TLS
    records = list(read_metrics(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(60))
    assert all(set(r["site_ids"]) == SITES for r in records)
    assert not any(key.startswith("test_") for r in records for key in r)  # the coordinator holds no data

    evaluated = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evaluated] == [19, 39, 59]
    for record in evaluated:
        by_site = record["eval_by_site"]
        assert set(by_site) == SITES
        assert record["eval_samples"] == sum(s["samples"] for s in by_site.values())
        for name in ("accuracy", "loss"):
            weighted = sum(s[name] * s["samples"] for s in by_site.values()) / record["eval_samples"]
            assert record[f"eval_{name}"] == pytest.approx(weighted)
    # 569 patients split 250/170/149, a fifth of each held out
    assert {site: s["samples"] for site, s in evaluated[-1]["eval_by_site"].items()} == {"hospital-a": 50, "hospital-b": 34, "hospital-c": 30}
    assert evaluated[-1]["eval_accuracy"] > 0.85
    assert "held-out accuracy" in result.stdout
    for name in ("summary.json", "loss.png", "eval.png", "model.pt"):
        assert (run / name).is_file(), name
