"""``dadfl.workloads.partition`` — splitting one training set across simulated sites.

Schemes (the usual non-IID benchmarks of federated learning):

- ``"iid"``: a seeded shuffle cut into near-equal parts.
- ``"dirichlet"``: label skew (Hsu et al. 2019). For every class, the shares of the
  sites are drawn from Dirichlet(alpha); small alpha gives each site few classes.
- ``"quantity"``: quantity skew. Site sizes are proportional to one Dirichlet(alpha)
  draw; labels stay IID.

Every scheme returns disjoint, sorted index tensors whose union is every sample, and
gives each site at least ``min_per_site`` samples. All randomness comes from a
generator seeded by ``seed``, so a partition is reproduced from its arguments alone.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


SCHEMES = ("iid", "dirichlet", "quantity")


def partition(
    n_sites: int,
    n_samples: int,
    scheme: str = "iid",
    *,
    labels: torch.Tensor | Sequence[int] | np.ndarray | None = None,
    alpha: float = 0.5,
    seed: int = 0,
    min_per_site: int = 1,
) -> list[torch.Tensor]:
    """Indices (int64, sorted) of the samples each of ``n_sites`` sites holds."""
    if scheme not in SCHEMES:
        valid = ", ".join(map(repr, SCHEMES))
        raise ValueError(f"unknown partition scheme {scheme!r}; valid schemes are {valid}")
    if n_sites < 1:
        raise ValueError(f"n_sites must be at least 1, got {n_sites}")
    if n_samples < n_sites:
        raise ValueError(f"cannot split {n_samples} samples across {n_sites} sites: more sites than samples")
    if min_per_site < 0:
        raise ValueError(f"min_per_site must be non-negative, got {min_per_site}")
    if n_sites * min_per_site > n_samples:
        raise ValueError(
            f"{n_sites} sites with at least {min_per_site} samples each need {n_sites * min_per_site} "
            f"samples, but there are only {n_samples}; lower min_per_site or n_sites"
        )
    if scheme != "iid" and not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a positive finite number for the {scheme!r} scheme, got {alpha!r}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n_samples), n_sites)
    elif scheme == "quantity":
        sizes = _quantity_sizes(rng, n_sites, n_samples, alpha, min_per_site)
        parts = np.split(rng.permutation(n_samples), np.cumsum(sizes)[:-1])
    else:
        if labels is None:
            raise ValueError("the 'dirichlet' scheme skews labels and needs labels= (one class per sample)")
        parts = _label_skew(rng, n_sites, _as_labels(labels, n_samples), alpha, min_per_site)
    return [torch.from_numpy(np.sort(part)).to(torch.int64) for part in parts]


def _as_labels(labels: torch.Tensor | Sequence[int] | np.ndarray, n_samples: int) -> np.ndarray:
    array = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if array.shape != (n_samples,):
        raise ValueError(f"labels must have shape ({n_samples},), one per sample, got {array.shape}")
    return array


def _quantity_sizes(
    rng: np.random.Generator, n_sites: int, n_samples: int, alpha: float, min_per_site: int
) -> np.ndarray:
    """``min_per_site`` each, the rest shared in Dirichlet proportions (largest remainders)."""
    shares = rng.dirichlet(np.full(n_sites, alpha))
    free = n_samples - n_sites * min_per_site
    exact = shares * free
    sizes = np.floor(exact).astype(np.int64)
    leftover = free - sizes.sum()
    sizes[np.argsort(-(exact - sizes), kind="stable")[:leftover]] += 1
    return sizes + min_per_site


def _label_skew(
    rng: np.random.Generator, n_sites: int, labels: np.ndarray, alpha: float, min_per_site: int
) -> list[np.ndarray]:
    """Per class, Dirichlet(alpha) shares across sites; then top up sites below the minimum."""
    site_samples: list[list[int]] = [[] for _ in range(n_sites)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(n_sites, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for site, chunk in enumerate(np.split(members, cuts)):
            site_samples[site].extend(chunk.tolist())
    _top_up(site_samples, min_per_site)
    return [np.asarray(samples, dtype=np.int64) for samples in site_samples]


def _top_up(site_samples: list[list[int]], min_per_site: int) -> None:
    """Move samples from the largest site (lowest index on ties) to each site below the minimum.

    Deterministic, and it changes as little as possible: the donor always keeps at least
    ``min_per_site``, which is possible because the caller checked there are enough samples.
    """
    for site, samples in enumerate(site_samples):
        while len(samples) < min_per_site:
            donor = max(range(len(site_samples)), key=lambda s: (len(site_samples[s]), -s))
            moved = min(min_per_site - len(samples), len(site_samples[donor]) - min_per_site)
            samples.extend(site_samples[donor][-moved:])
            del site_samples[donor][-moved:]
