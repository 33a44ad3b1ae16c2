"""Large blocks torch frees stay in the process for the next step, instead of going back to the OS.

glibc's malloc serves each block above its mmap threshold (at most 32 MB: logits,
gradients, the optimizer's temporaries) with a fresh mmap and unmaps it on free,
so every CPU training step page-faults and zeroes hundreds of MB anew: 12-28 % of
a step on the machine measured (benchmarks/README.md). Keeping them in the heap
changes where tensors live, never what they hold; the process keeps its peak
memory until it exits.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: free memory at the top of the heap beyond 2 GB still goes back.
KEEP_AT_MOST = 2**31 - 1


def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and keep them when freed; False where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # another C library (musl has no mallopt)
        return False
    no_mmap = mallopt(M_MMAP_MAX, 0)
    no_trim = mallopt(M_TRIM_THRESHOLD, KEEP_AT_MOST)
    return bool(no_mmap and no_trim)
