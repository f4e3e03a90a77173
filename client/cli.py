"""``dadfl.client.cli`` — the site command: ``dadfl site --config configs/site-a.toml``; ``dadfl/cli.py`` registers it."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from dadfl.config import ConfigError, load_config
from dadfl.failures import fail, keep_secret, set_debug, unexpected
from dadfl.memory import return_freed_memory

from .config import SiteConfig
from dadfl.data_files import DataMismatch
from dadfl.trust.run_checks import RunRefused
from .site import GaveUp, SiteRefused, run_site


def site(
    config: Path = typer.Option(..., "--config", help="site TOML, e.g. configs/site-a.toml (printed by `dadfl enroll`)"),
    insecure: bool = typer.Option(False, "--insecure", help="connect in plain text (no TLS): trusted networks and tests only"),
    verbose: bool = typer.Option(False, "--verbose", help="debug logging"),
    debug: bool = typer.Option(False, "--debug", help="print the traceback of a failure (never local variables)"),
) -> None:
    """Join a coordinator and train on this site's data until the run finishes."""
    return_freed_memory()  # model-sized buffers go back to the system when freed (dadfl/memory.py)
    set_debug(debug)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = load_config(config, SiteConfig)
        if settings.state_dir is None:
            settings = settings.model_copy(update={"state_dir": config.parent / f"{settings.site_id}-state"})
        keep_secret(settings.token)
        summary = run_site(settings, insecure=insecure)
    except ConfigError as exc:
        fail(str(exc), 2, exc)
    except (RunRefused, DataMismatch) as exc:
        fail(f"{exc} (site config {config})", 2, exc)
    except (SiteRefused, ValueError) as exc:
        fail(f"{config}: {exc}", 2, exc)
    except GaveUp as exc:
        fail(str(exc), 1, exc)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        unexpected(exc)
    typer.echo(f"{settings.site_id}: {summary.steps} steps, {summary.repairs} block repairs, {summary.resyncs} full-state resyncs, {summary.connections} connections; {summary.finished}")
