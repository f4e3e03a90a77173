"""The built-in character workloads with a label per training sequence.

Label skew (Dirichlet over classes) needs a class per sample; next-character prediction
has none. The training windows of ``dadfl.workloads.text`` are kept in corpus order
(the help topics sorted by key), so numbering them into ``SECTIONS`` contiguous runs
gives each window the section of the Python documentation it comes from. Dirichlet
label skew over sections then gives each site text mostly from a few sections — topic
skew, the text analogue of a site that sees only some digits. Models, data and metric
are the built-in ones, unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from dadfl.workloads import Workload
from dadfl.workloads import text

SECTIONS = 10


def with_section_labels(workload: Workload) -> Workload:
    count = len(workload.train)
    labels = torch.arange(count) * SECTIONS // count
    return dataclasses.replace(workload, labels=labels)


def char_gru(**options) -> Workload:
    return with_section_labels(text.gru(**options))


def char_transformer(**options) -> Workload:
    return with_section_labels(text.transformer(**options))
