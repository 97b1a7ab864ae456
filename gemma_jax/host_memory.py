"""Host memory that XLA's CPU temporaries reuse instead of faulting in afresh each step.

glibc's malloc hands a large request fresh pages from `mmap` (so does a worker thread's
own arena for any request its heap cannot hold) and returns them on `free`. A CPU train
step's temporaries are gigabytes allocated and freed every step, so every step touched
each of their pages for the first time again: ~370k page faults in the d_model 512
Gemma 3 step of `benchmarks/side_by_side.py`, about a fifth of its time on the 2-core
CI machine. `keep_freed_memory` makes malloc serve every thread from one arena, never
`mmap`, and never give memory back, so the second step on reuses the first one's pages.

`import gemma_jax` calls it where JAX will run on the CPU (`keep_freed_memory_on_cpu`),
so a user's own loop gets the speed without knowing of it; set
GEMMA_JAX_KEEP_FREED_MEMORY=0 to keep glibc's defaults.
"""

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory for reuse (one arena, no mmap, no trim).

  Call it before JAX's first computation: threads that already have their own arena
  keep it. The process then holds on to its peak host memory. Returns False, changing
  nothing, where the C library is not glibc.
  """
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = libc.mallopt
    libc.gnu_get_libc_version   # only glibc has it; musl and macOS raise AttributeError
  except (OSError, AttributeError, TypeError):
    return False
  return all(mallopt(option, value) == 1 for option, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))   # -1: never trim


OPT_OUT = "GEMMA_JAX_KEEP_FREED_MEMORY"


def accelerator_installed() -> bool:
  """Whether JAX will run on something else than the CPU: JAX_PLATFORMS names another
  platform first, or (unset) a GPU or TPU plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() != "cpu"
  if importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("libtpu"):
    return True
  return bool(importlib.metadata.entry_points(group="jax_plugins"))


def keep_freed_memory_on_cpu() -> bool:
  """`keep_freed_memory()` where the CPU runs JAX's computations (no accelerator
  installed) and $GEMMA_JAX_KEEP_FREED_MEMORY is not 0; an accelerator's host does
  little of a step's work, so there it changes nothing. Returns whether it was set."""
  if os.environ.get(OPT_OUT, "1") == "0" or accelerator_installed():
    return False
  return keep_freed_memory()
