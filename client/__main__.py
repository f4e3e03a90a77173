"""``python -m dadfl.client --config configs/site-a.toml``: a site without the rest of the CLI."""

import typer

from .cli import site

typer.run(site)
