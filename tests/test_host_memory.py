"""keep_freed_memory: 64 MiB that a worker thread mallocs, fills and frees is faulted in
once, not again when it mallocs the same size, counted in fresh processes against one
that does not call it (where glibc maps and unmaps the block each time). `import
gemma_jax` calls it on a CPU-only install, unless told not to or an accelerator is the
platform. Where the C library is not glibc, it must report that it changed nothing."""

import os
import platform
import subprocess
import sys

import pytest

from gemma_jax import host_memory
from test_training import REPO

# In a new thread (as XLA's own threads allocate), twice: malloc 64 MiB, fill, free.
# Prints the minor page faults of the second time and the pages of the block.
SCRIPT = """
import ctypes, resource, sys, threading
import gemma_jax
from gemma_jax import host_memory
if sys.argv[1] == "call":
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


def second_time_faults(mode: str = "import", **environment):
  """(faults of the second fill, pages of the block) in a fresh process that imports
  gemma_jax under `environment` (JAX_PLATFORMS unset unless given) and, for mode "call",
  then calls keep_freed_memory."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", host_memory.OPT_OUT)}
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, check=True,
                       capture_output=True, text=True, env=dict(env, **environment))
  faults, pages = out.stdout.split()
  return int(faults), int(pages)


GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.slow
def test_keep_freed_memory_stops_a_freed_block_faulting_in_again():
  if not GLIBC:                                     # musl, macOS: nothing to set, nothing set
    assert host_memory.keep_freed_memory() is False
    return
  default, pages = second_time_faults(GEMMA_JAX_KEEP_FREED_MEMORY="0")
  kept, _ = second_time_faults("call", GEMMA_JAX_KEEP_FREED_MEMORY="0")
  assert default > pages / 2, (default, pages)      # mapped afresh, faulted in again
  assert kept < pages / 50, (kept, pages)           # reused: almost no faults


@pytest.mark.slow
def test_importing_gemma_jax_keeps_freed_memory_where_the_cpu_runs_jax(monkeypatch):
  """With JAX_PLATFORMS=cpu the import alone sets it; with a GPU named first, or the
  opt-out, it leaves malloc alone."""
  for platforms, accelerator in [("cpu", False), ("cpu,cuda", False), ("cuda,cpu", True),
                                 ("tpu", True)]:
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert host_memory.accelerator_installed() is accelerator, platforms
  monkeypatch.setenv(host_memory.OPT_OUT, "0")
  assert host_memory.keep_freed_memory_on_cpu() is False
  if not GLIBC:
    monkeypatch.setenv(host_memory.OPT_OUT, "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.keep_freed_memory_on_cpu() is False   # nothing to set
    return
  imported, pages = second_time_faults(JAX_PLATFORMS="cpu")
  on_gpu, _ = second_time_faults(JAX_PLATFORMS="cuda,cpu")
  opted_out, _ = second_time_faults(JAX_PLATFORMS="cpu", GEMMA_JAX_KEEP_FREED_MEMORY="0")
  assert imported < pages / 50, (imported, pages)
  assert on_gpu > pages / 2 and opted_out > pages / 2, (on_gpu, opted_out, pages)
