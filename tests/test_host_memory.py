"""keep_freed_memory: a jitted function's large buffer faults its pages in once, not on
every call, measured in fresh processes against one that does not call it."""

import subprocess
import sys

import pytest

from test_training import REPO

# Runs a function with a 64 MiB result 3 times to warm up, then prints the minor page
# faults per call of 3 more, and the pages of that result.
SCRIPT = """
import resource, sys
from gemma_jax import host_memory
if sys.argv[1] == "keep":
  assert host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 64), jnp.float32) / 64
f = jax.jit(lambda x: x @ x.T)                  # [4096, 4096], freed once each call is done
for _ in range(3):
  jax.block_until_ready(f(x))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
  jax.block_until_ready(f(x))
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 3, 4096 * 4096 * 4 // 4096)
"""


def faults_per_call(mode: str):
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, check=True,
                       capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu",
                                                            "PATH": "/usr/bin:/bin"})
  faults, pages = out.stdout.split()
  return float(faults), int(pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_keep_freed_memory_stops_the_temporaries_faulting_in_again():
  default, pages = faults_per_call("default")
  kept, _ = faults_per_call("keep")
  assert default > pages / 2, (default, pages)      # each call faults the buffer in
  assert kept < pages / 50, (kept, pages)           # reused: almost no faults
