"""``dadfl.server.__main__`` — ``python -m dadfl.server --config configs/server.toml``: the coordinator without the rest of the CLI."""

import typer

from .cli import server

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
app.command()(server)
app()
