"""agentloop.allocator: with glibc told to keep freed memory, a step that allocates and frees the same large
tensors stops page-faulting them in again. The baseline pins glibc's initial thresholds (128 KiB), which
its dynamic adjustment otherwise moves depending on the process's history; each process is measured on
its own, as the setting is per process."""

from __future__ import annotations

import subprocess
import sys

STEPS = """
import resource, sys
import torch
from agentloop import allocator
if sys.argv[1] == "keep":
    assert allocator.keep_freed_memory()
else:
    import ctypes
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    assert mallopt(allocator.M_MMAP_THRESHOLD, 128 * 1024) and mallopt(allocator.M_TRIM_THRESHOLD, 128 * 1024)

def step():
    tensors = [torch.ones(1024 * 1024) for _ in range(4)]  # 4 MiB each, freed together
    return sum(float(tensor[0]) for tensor in tensors)

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


def test_kept_memory_is_reused_without_page_faults():
    pages_per_step = 4 * 1024 * 1024 * 4 // 4096
    baseline, kept = page_faults("baseline"), page_faults("keep")
    assert baseline > 5 * pages_per_step  # the freed tensors went back to the kernel and faulted in again
    assert kept * 5 < baseline, (kept, baseline)


RELEASE = """
import psutil, torch
from agentloop import allocator
assert allocator.keep_freed_memory()
process = psutil.Process()
tensors = [torch.ones(1024 * 1024) for _ in range(64)]  # 4 MiB each, 256 MiB in all: on the kept heap
del tensors
kept = process.memory_info().rss
assert allocator.release_freed_memory()
print(kept - process.memory_info().rss)
"""


def test_released_memory_goes_back_to_the_kernel():
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120, check=True)
    assert int(done.stdout.split()[-1]) > 200 * 2**20  # the freed 256 MiB left the process's resident memory
