"""``dadfl.cli`` — the ``dadfl`` command: simulate a federation, run a coordinator, run a site."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dadfl.client import cli as client_cli
from dadfl.server import cli as server_cli
from dadfl.server.processes import simulate_processes

from .config import ConfigError, load_config, validate_config
from .failures import set_debug
from .metrics import MetricsWriter, write_summary
from .privacy.accounting import dp_strategies
from .replica import resolve_device
from .report import by_strategy, human_bytes, suggested_ranks, write_plots
from .simulation import SimulationConfig, StrategySpec, run_directory, simulate

app = typer.Typer(
    help="Federated learning that shares auto-differentiation factors.", no_args_is_help=True, pretty_exceptions_show_locals=False
)
console = Console()


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"dadfl {version('dadfl')}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    debug: bool = typer.Option(False, "--debug", help="print the traceback of a failure (never local variables)"),
) -> None:
    """dadfl: train one shared model across sites that never move their data."""
    set_debug(debug)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {escape(message)}")  # a message's own [brackets] are text, not markup
    raise typer.Exit(2)


@app.command()
def sim(
    config: Optional[Path] = typer.Option(None, help="simulation TOML (see configs/simulation.toml); flags override it"),
    workload: Optional[str] = typer.Option(None, help="built-in name (digits-mlp, digits-cnn, breast-cancer-mlp, char-gru, char-transformer) or module:factory"),
    strategies: Optional[str] = typer.Option(None, help="';'-separated, e.g. 'dsgd;rankdad:rank=4,reduce_on_server=true'"),
    sites: Optional[int] = typer.Option(None, help="number of sites"),
    steps: Optional[int] = typer.Option(None, help="training steps"),
    batch_size: Optional[int] = typer.Option(None, help="samples per site per step"),
    partition: Optional[str] = typer.Option(None, help="iid, dirichlet or quantity"),
    alpha: Optional[float] = typer.Option(None, help="Dirichlet concentration for label/quantity skew"),
    lr: Optional[float] = typer.Option(None, help="learning rate"),
    seed: Optional[int] = typer.Option(None, help="seed for data split, batches and model"),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default 1)"),
    precision: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16: autocast of the sites' forward/backward"),
    workload_path: list[Path] = typer.Option([], "--workload-path", help="folder holding a workload package that is not installed (repeatable)"),
    out: Path = typer.Option(Path("runs"), help="folder for run directories"),
    mode: str = typer.Option("inprocess", help="inprocess (one process), processes (a coordinator and N site processes over loopback gRPC) or flower (a Flower ServerApp/ClientApp simulation)"),
    dp_epsilon: Optional[float] = typer.Option(None, help="train with differential privacy to this ε (the [dp] section's target_epsilon; docs/privacy.md)"),
) -> None:
    """Simulate a federation in one process and compare strategies."""
    try:
        base = load_config(config, SimulationConfig).model_dump() if config else SimulationConfig().model_dump()
        explicit = strategies is not None or (config is not None and "strategies" in _toml_keys(config))
        overrides = {
            "workload": workload, "sites": sites, "steps": steps, "batch_size": batch_size,
            "partition": partition, "alpha": alpha, "seed": seed, "device": device, "threads": threads,
            "precision": precision,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        if workload_path:
            base["workload_path"] = [str(path) for path in workload_path]
        if lr is not None:
            base["optimizer"] = {**base["optimizer"], "lr": lr}
        if strategies is not None:
            base["strategies"] = [StrategySpec.parse(s).model_dump() for s in strategies.split(";") if s.strip()]
        if dp_epsilon is not None:
            base["dp"] = {**(base.get("dp") or {}), "target_epsilon": dp_epsilon}
        if base.get("dp") and not explicit:  # the default list: keep the strategies DP can run
            base["strategies"] = [s for s in base["strategies"] if s["name"] in dp_strategies()]
        settings = validate_config(base, SimulationConfig, source=str(config or "command line"))
        resolve_device(settings.device)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
        return

    runners = {"inprocess": simulate, "processes": simulate_processes, "flower": _simulate_flower}
    if mode not in runners:
        fail(f"--mode {mode!r} is not one of {', '.join(runners)}")
    if settings.dp is not None and mode == "flower":
        fail("[dp] runs with --mode inprocess or processes (and dadfl server/site); the Flower integration does not add the noise yet")
    specs = _applicable(settings, explicit)
    run_dir = run_directory(out)
    (run_dir / "config.json").write_text(json.dumps(settings.model_dump(), indent=2))
    console.print(
        f"[bold]dadfl sim[/bold]: {settings.workload}, {settings.sites} sites ({settings.partition}), "
        f"{settings.batch_size} samples per site per step, {settings.steps} steps, {mode} -> {run_dir}"
    )
    summaries = []
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics, Progress(*columns, console=console) as bar:
        for spec in specs:
            task = bar.add_task(spec.display, total=settings.steps)
            summaries.append(runners[mode](settings, spec, metrics, lambda _: bar.advance(task)))
    write_summary(run_dir / "summary.json", summaries)
    plots = write_plots(run_dir)
    console.print(summary_table(summaries, specs))
    for label, records in by_strategy(run_dir / "metrics.jsonl").items():
        suggested = suggested_ranks(records)
        if suggested:  # the first factor strategy's: a rank to try per layer
            console.print(f"{label}: components holding 90% of the summed gradient's energy (median over steps), "
                          "per layer: " + ", ".join(f"{layer}: {rank}" for layer, rank in suggested.items()), highlight=False)
            break
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {', '.join(p.name for p in plots)}")


def _simulate_flower(settings: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress) -> dict:
    try:
        from .flower import simulate_flower  # flwr is optional
    except ImportError as exc:
        fail(f"--mode flower needs Flower's simulation engine: pip install 'dadfl[flower]' ({exc})")
    return simulate_flower(settings, spec, metrics, progress)


def _toml_keys(path: Path) -> set[str]:
    import tomllib

    return set(tomllib.loads(path.read_text()))


def _applicable(settings: SimulationConfig, explicit: bool) -> list[StrategySpec]:
    """Strategies that can train this workload; defaults that cannot are skipped with a note."""
    from dadfl.strategies import make_strategy
    from dadfl.workloads import load_workload

    from .replica import Replica

    workload = load_workload(settings.workload, settings.workload_path, **settings.workload_options)
    chosen = []
    for spec in settings.strategies:
        try:
            Replica(workload, make_strategy(spec.name, **spec.options), settings.optimizer, resolve_device(settings.device),
                    precision=settings.precision)
        except ValueError as exc:
            if explicit:
                fail(f"{spec.display}: {exc}")
            console.print(f"[yellow]skipping {spec.display}[/yellow]: {exc}")
            continue
        chosen.append(spec)
    return chosen


# A strategy name longer than this gets a numbered short name and a legend line, so the table
# fits an 80-column terminal instead of wrapping the name letter by letter.
NAME_WIDTH = 20


def summary_table(summaries: list[dict], specs: list[StrategySpec] = ()) -> Table:
    """One row per strategy; the caption says what each sends of the raw-input layer (the
    comparison's exposure, from ``specs``) and spells out names too long for the column."""
    metric = summaries[0]["metric_name"] if summaries else "metric"
    steps = summaries[0]["steps"] if summaries else 0
    table = Table(
        title=f"After {steps} steps: held-out {metric} and loss; payload bytes per step "
        "(all sites) up and down; ms per step",
        box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
    )
    private = any("dp_epsilon" in s for s in summaries)
    for column in ("strategy", metric, "test loss", "up", "down", "ms/step") + (("ε",) if private else ()):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    legend = []
    for s in summaries:
        name = s["strategy"]
        if len(name) > NAME_WIDTH:
            legend.append(f"[{len(legend) + 1}] {name}")
            name = f"{name[: NAME_WIDTH - 5]}… [{len(legend)}]"
        table.add_row(
            name,
            f"{s['metric']:.4f}",
            f"{s['test_loss']:.4f}",
            human_bytes(s["bytes_up_per_step"]),
            human_bytes(s["bytes_down_per_step"]),
            f"{s['seconds_per_step'] * 1000:.1f}",
            *((f"{s['dp_epsilon']:.3g}" if "dp_epsilon" in s else "-",) if private else ()),
        )
    exposure: dict[str, list[str]] = {}
    for spec in specs:
        exposure.setdefault(spec.raw_input_exposure(), []).append(spec.display)
    lines = [f"Raw-input layer sent as {kind}: {', '.join(names)}." for kind, names in exposure.items()]
    table.caption = "\n".join(escape(line) for line in lines + legend) or None
    return table


app.command("server")(server_cli.server)
app.command("enroll")(server_cli.enroll)
app.command("certs")(server_cli.certs)
app.command("site")(client_cli.site)
app.command("status")(server_cli.status)
app.command("readmit")(server_cli.readmit)
app.command("stop")(server_cli.stop)
audit_app = typer.Typer(help="Audit trails: what left a site, and what happened at the coordinator.", no_args_is_help=True)
audit_app.command("verify")(server_cli.audit_verify)
app.add_typer(audit_app, name="audit")


if __name__ == "__main__":
    app()
