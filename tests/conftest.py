"""Shared by every test folder: the files that hold ``slow`` tests are collected first.

``make test`` runs ``pytest -n auto --dist loadfile --no-loadscope-reorder``: each file goes whole
to one worker, in collection order. Handing out the longest files first (longest-processing-time
scheduling) keeps a long file from starting last while the other workers sit idle.
"""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: each file's own order stays
