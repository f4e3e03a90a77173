"""``dadfl.strategies`` — strategies: the math only, pure torch, no I/O.

Each strategy has a site half (local forward/backward -> payload; messages -> next
payload) and a server half (payloads of one phase -> one message), and decodes the
server's messages into the update every replica applies.
"""

from __future__ import annotations

import dataclasses

from .auto import Auto
from .base import LocalResult, Payload, Strategy
from .dad import DAD
from .dsgd import DSGD
from .edad import EDAD
from .layout import CapturedLayer, Layout
from .local_steps import DiLoCo, FedAvg
from .powersgd import PowerSGD
from .probe import probe_layout
from .rankdad import RankDAD
from .step import Traffic, apply_update, exchange, reference_update, step_update, weights_fingerprint
from .capture import local_step

STRATEGIES: dict[str, type[Strategy]] = {"dsgd": DSGD, "dad": DAD, "auto": Auto, "edad": EDAD, "rankdad": RankDAD, "powersgd": PowerSGD, "fedavg": FedAvg, "diloco": DiLoCo}


def make_strategy(name: str, **options) -> Strategy:
    """Build a strategy by name; unknown names or options get an error listing the valid ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(
            f"strategy {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(sorted(fields)) or 'none'}"
        )
    return cls(**options)


__all__ = [
    "STRATEGIES",
    "make_strategy",
    "Strategy",
    "Payload",
    "LocalResult",
    "Layout",
    "CapturedLayer",
    "probe_layout",
    "Traffic",
    "exchange",
    "local_step",
    "step_update",
    "reference_update",
    "apply_update",
    "weights_fingerprint",
]
