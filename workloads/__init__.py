"""``dadfl.workloads`` — workloads: a model factory, its data, a per-sample loss and a metric.

Built-in ones (``digits-mlp``, ``digits-cnn``, ``breast-cancer-mlp``, ``char-gru``,
``char-transformer``, ``char-transformer-100m``) use only data bundled with scikit-learn or Python; any other is
plugged in as ``"package.module:factory"``. ``partition`` splits a training set across
simulated sites (IID, label skew, quantity skew) and ``site_batches`` serves one
site's minibatch of any step (``batches.py``).
"""

from .base import BUILTIN, LARGE, Split, Workload, load_workload
from .batches import SplitDataset, StepBatches, batch_positions, site_batches
from .partition import partition

__all__ = [
    "BUILTIN",
    "LARGE",
    "Split",
    "SplitDataset",
    "StepBatches",
    "Workload",
    "batch_positions",
    "load_workload",
    "partition",
    "site_batches",
]
