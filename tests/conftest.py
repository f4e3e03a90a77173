"""Shared by every test folder: how ``make test`` spreads the tests over workers.

``make test`` runs ``pytest -n auto --dist loadgroup --no-loadscope-reorder``: tests go one by one
to whichever worker is free, in collection order, except those that share a fixture wider than
a test (module or class scope: a suite run once, a server started once), which stay together on
one worker so that it is built once. The files that hold ``slow`` tests are collected first, so
that a long test does not start last while the other workers sit idle.
"""

from __future__ import annotations

import pytest

SHARED_SCOPES = {"module", "class", "package"}


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: each file's own order stays
    if not config.pluginmanager.hasplugin("xdist"):  # one process: nothing to keep together
        return
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
        if any(d.scope in SHARED_SCOPES for defs in definitions for d in defs):
            item.add_marker(pytest.mark.xdist_group(str(item.path)))
