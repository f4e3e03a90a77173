"""``dadfl.client.__main__`` — ``python -m dadfl.client --config configs/site-a.toml``: a site without the rest of the CLI."""

import typer

from .cli import site

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
app.command()(site)
app()
