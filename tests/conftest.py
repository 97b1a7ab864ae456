"""Shared fixtures, and the XLA set-up of every test process (workers and the apps they
start inherit it): the flags must be set before jax is imported, and conftest.py is
imported before any test module.

- eight simulated CPU devices, for the sharding tests;
- XLA's backend optimisations off: the tests' models are tiny, so their time is almost
  all compilation, which this halves (results stay float32-exact: no fast math);
- one persistent compilation cache for the whole run, so the many tests (and train.py
  subprocesses) that build the same tiny model compile it once.
"""

import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
     "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]).strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "gemma_jax_tests_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  """Eight real documents (the heads of stdlib modules) as .txt files; their glob."""
  from gemma_jax.training import data  # pylint: disable=import-outside-toplevel
  directory = tmp_path_factory.mktemp("corpus")
  for i, filename in enumerate(data.stdlib_files()[:8]):
    with open(filename, encoding="utf-8") as f:
      (directory / f"{i}.txt").write_text(f.read()[:3000], encoding="utf-8")
  return str(directory / "*.txt")
