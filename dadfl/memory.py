"""``dadfl.memory`` — freed model-sized buffers go back to the operating system (glibc's malloc).

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with a
mapping of its own, which ``free`` returns to the system at once. But each time such a block
is freed it raises the threshold to that block's size (up to 32 MiB), so later blocks of that
size come from the heap, where a freed block stays resident until everything above it is free
too. A coordinator or a site handles every model-sized message as 1 MiB chunks and
per-parameter tensors of every size, so the heap fills with such holes: the peak resident set
of a site of the 100M-parameter setting measured 1.3 GB higher with the moving threshold
than with a fixed one (``bench/bench_large.py``, docs/benchmarks-runtime.md).

``return_freed_memory`` fixes the threshold at 1 MiB: temporaries below it (the canonical
step's 128 KiB chunks) stay on the heap with no system call each, everything larger is mapped
and unmapped. The price is system time: every large tensor is a fresh mapping whose pages
fault in when first written (the benchmark's processes spent 197 s in the kernel against
65 s, their user time unchanged). To choose otherwise, set glibc's own
``MALLOC_MMAP_THRESHOLD_`` in the environment (e.g. 33554432, glibc's ceiling): this
function then leaves it alone. Elsewhere than on glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20
ENVIRONMENT_SETTING = "MALLOC_MMAP_THRESHOLD_"


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process, unless the
    environment sets one; whether it was set."""
    if ENVIRONMENT_SETTING in os.environ:  # the operator's choice, which glibc applied at start
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # another libc: its own policy
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
