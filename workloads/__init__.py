"""Workloads: a model factory, its data, a per-sample loss and a metric.

Built-in ones (``digits-mlp``, ``digits-cnn``, ``breast-cancer-mlp``, ``char-gru``,
``char-transformer``) use only data bundled with scikit-learn or Python; any other is
plugged in as ``"package.module:factory"``. ``partition`` splits a training set across
simulated sites (IID, label skew, quantity skew) and ``site_batches`` streams one
site's minibatches.
"""

from .base import BUILTIN, Split, Workload, load_workload
from .partition import partition, site_batches

__all__ = ["BUILTIN", "Split", "Workload", "load_workload", "partition", "site_batches"]
