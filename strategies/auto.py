"""``dadfl.strategies.auto`` — auto: per layer and step, whichever exact form is smaller — dense gradient or factors.

dAD's factors cost n_s·(k + m) floats per group where the gradient costs k·m (+ m bias).
Which is smaller depends on the batch: rows grow with batch size, sequence length and
convolution positions. ``auto`` decides per layer and per step, on each side:

    up   = min(n_s·G·(k + m),  G·k·m + G·m)            per site (site decides on n_s)
    down = min(N·G·(k + m),    G·k·m + G·m)            factors only if every site sent them

counted in bytes, so an embedding's lookups cost n_s·(4 + d·4) bytes in fp32 (int32 ids)
against V·d·4 for its dense gradient (a tied head adds its rows to the factor side); under
bf16/fp16 autocast a linear's factors cost 2 bytes a number against the fp32 gradient's 4.

Both forms are exact, so the update equals dSGD's whatever is chosen. Uncovered
parameters and buffers travel dense. Reveals what dAD reveals for layers sent as
factors and what dSGD reveals for the rest; the raw-input guard of dAD applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Strategy, check_raw_input, may_share
from .dad import FactorServer, FactorSite, dense_nbytes, factor_units
from .layout import CapturedLayer, Layout
from .payload import Factors


@dataclass(frozen=True)
class Auto(Strategy):
    raw_input: str = "dense"
    name = "auto"
    exact = True
    supports_dp = True

    def __post_init__(self) -> None:
        check_raw_input(self.raw_input)

    def sends_factors(self, layer: CapturedLayer, factors: Factors) -> bool:
        return may_share(layer, self.raw_input, "activations") and factors.nbytes() < dense_nbytes(layer)

    def site(self, layout: Layout, model=None) -> FactorSite:
        return FactorSite(layout, self.sends_factors)

    def server(self, layout: Layout, model=None) -> FactorServer:
        return FactorServer(layout, "smaller")

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        """As dAD: a site picks factors or dense per layer by its own row count."""
        return factor_units(layout, facts, self.raw_input) if phase == 0 else None
