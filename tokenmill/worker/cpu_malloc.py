"""Keep large CPU buffers in the heap between steps (glibc ``mallopt``).

glibc serves an allocation above its mmap threshold (128 KiB at first, adapting upwards) with a
fresh ``mmap`` and returns it to the kernel on free. A decode step allocates and frees the same large
activations every time (the float32 logits of 64 sequences are 12.6 MB), so each step would fault
in and zero those pages again: about a millisecond per 10 MB. Raising the mmap threshold to glibc's
maximum and keeping freed memory in the heap (a high trim threshold) makes steps reuse warm pages.
The cost is that the process keeps up to its peak activation memory after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit machines (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def keep_large_buffers_in_heap() -> bool:
    """Apply the thresholds above to this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False  # musl and others have no (or an inert) mallopt
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    logger.debug("glibc malloc thresholds raised: %s", ok)
    return ok
