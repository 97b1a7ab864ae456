"""Compiled programs kept on disk, so that the next process running the same program
loads it instead of compiling it again.

XLA compiles every app's programs anew in each process: gemma4-moe-tiny's training step
takes ~20 s to compile on a 2-core CPU. JAX's persistent compilation cache keeps the
executables, keyed by the program, its compile options, the backend and the jax
version, and loads them on a later run (that step: 2-3 s,
`benchmarks/compile_time.py --cached`). The apps in experiments/ turn it on (`gemma_jax.apps`,
--compilation_cache_dir); a user's own program turns it on with `enable()`.
"""

import os
from typing import Optional

import jax

MAX_BYTES = 4 * 2**30   # beyond this, the least recently used programs are evicted


def default_directory() -> str:
  """$XDG_CACHE_HOME/gemma_jax/xla (~/.cache/gemma_jax/xla)."""
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(cache_home), "gemma_jax", "xla")


def enable(directory: Optional[str] = None) -> Optional[str]:
  """Keeps the programs that take JAX's threshold or more to compile (a second unless
  `jax_persistent_cache_min_compile_time_secs` says otherwise) in `directory`, evicting
  the least recently used beyond `MAX_BYTES`; returns the directory, or None when off.

  directory: a local path or one JAX's cache can write (gs://...); None: JAX's own
  setting where there is one ($JAX_COMPILATION_CACHE_DIR or `jax_compilation_cache_dir`,
  left as configured), else `default_directory()`; "": no cache, whatever JAX's setting.
  Call it before the first compilation.
  """
  if directory == "":
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if directory is None and jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  directory = os.path.expanduser(directory or default_directory())   # JAX makes it
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return directory
