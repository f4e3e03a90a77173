"""The site command: ``dadfl site --config configs/site-a.toml``; ``dadfl/cli.py`` registers it."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from dadfl.config import ConfigError, load_config

from .config import SiteConfig
from .site import GaveUp, SiteRefused, run_site


def site(
    config: Path = typer.Option(..., "--config", help="site TOML, e.g. configs/site-a.toml (printed by `dadfl enroll`)"),
    insecure: bool = typer.Option(False, "--insecure", help="connect in plain text (no TLS): trusted networks and tests only"),
    verbose: bool = typer.Option(False, "--verbose", help="debug logging"),
) -> None:
    """Join a coordinator and train on this site's data until the run finishes."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = load_config(config, SiteConfig)
        if settings.state_dir is None:
            settings = settings.model_copy(update={"state_dir": config.parent / f"{settings.site_id}-state"})
        summary = run_site(settings, insecure=insecure)
    except (ConfigError, SiteRefused, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except GaveUp as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{settings.site_id}: {summary.steps} steps, {summary.resyncs} resyncs, {summary.connections} connections; {summary.finished}")
