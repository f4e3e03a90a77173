"""``python -m dadfl.server --config configs/server.toml``: the coordinator without the rest of the CLI."""

import typer

from .cli import server

typer.run(server)
