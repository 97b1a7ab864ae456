"""keep_freed_memory: 64 MiB that a worker thread mallocs, fills and frees is faulted in
once, not again when it mallocs the same size, counted in fresh processes against one
that does not call it (where glibc maps and unmaps the block each time). Where the C
library is not glibc, it must report that it changed nothing."""

import platform
import subprocess
import sys

from gemma_jax import host_memory
from test_training import REPO

# In a new thread (as XLA's own threads allocate), twice: malloc 64 MiB, fill, free.
# Prints the minor page faults of the second time and the pages of the block.
SCRIPT = """
import ctypes, resource, sys, threading
from gemma_jax import host_memory
if sys.argv[1] == "keep":
  assert host_memory.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size, faults = 64 << 20, []

def fill_and_free():
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  libc.free(ctypes.c_void_p(block))

def run():
  fill_and_free()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
  fill_and_free()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

thread = threading.Thread(target=run)
thread.start()
thread.join()
print(faults[1] - faults[0], size // 4096)
"""


def second_time_faults(mode: str):
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, check=True,
                       capture_output=True, text=True)
  faults, pages = out.stdout.split()
  return int(faults), int(pages)


def test_keep_freed_memory_stops_a_freed_block_faulting_in_again():
  if platform.libc_ver()[0] != "glibc":           # musl, macOS: nothing to set, nothing set
    assert host_memory.keep_freed_memory() is False
    return
  default, pages = second_time_faults("default")
  kept, _ = second_time_faults("keep")
  assert default > pages / 2, (default, pages)      # mapped afresh, faulted in again
  assert kept < pages / 50, (kept, pages)           # reused: almost no faults
