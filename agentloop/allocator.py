"""glibc's allocator tuned for processes that allocate and free the same large tensors at every step.

By default glibc hands freed blocks above 128 KiB back to the kernel (each such block is its own mapping,
and the top of the heap is trimmed), so the next step's tensors of the same sizes page-fault all over
again. On CPU that is a large share of a step: the engine's per-layer gathers in ``hf_varlen`` took 2-4x
longer with it. Serving allocations up to glibc's 32 MiB ceiling from the heap and never trimming it
keeps the pages for reuse; the process then holds on to its peak heap, as a caching allocator does.
After a one-off peak (a model read whole before it is sharded, the whole model gathered for a push) that heap
is gigabytes at real size: ``release_freed_memory`` hands its free pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest value glibc accepts on 64-bit machines


def _glibc_function(name: str) -> ctypes._CFuncPtr | None:
    """``name`` from the C library, None where the library is not glibc (musl has neither function)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (see the module); False where the C library is not glibc."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``), after a one-off peak that the next
    steps will not reuse; False where the C library is not glibc."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
