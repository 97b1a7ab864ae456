"""`jax.jit` for decoding's programs: on a CPU, compiled without XLA's tree-reduction
rewrite.

A decoded token is a chain of small kernels: at one row every norm, softmax and argmax
reduces a few dozen to a few thousand values, and on a CPU each of XLA's kernels
(thunks) costs microseconds whatever its size. XLA's CPU pipeline splits every
reduction over more than 32 values into a reduce-window and a reduce
(`TreeReductionRewriter`: pairwise-like sums for long float reductions), one more kernel
for each. Without it a decoding program has a quarter fewer kernels and a token takes
about a tenth less time (docs/performance.md, "Decoding without the tree-reduction
rewrite"). Training keeps the rewrite: its step ran slower without it. Other backends
compile as before: their reduction passes differ and were not measured without it.
"""

import functools

import jax

CPU_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}


def jit(fn, **jit_kwargs):
  """`jax.jit(fn, **jit_kwargs)`, compiled with `CPU_OPTIONS` where JAX's default backend
  is the CPU: called, and lowered with `.lower`, as a jitted function is. Traced inside
  another jit (which alone may carry compiler options) it is a plain nested `jax.jit`:
  the outer program's compilation decides."""
  with_options = jax.jit(fn, compiler_options=CPU_OPTIONS, **jit_kwargs)
  plain = jax.jit(fn, **jit_kwargs)

  def call(method, args, kwargs):
    if jax.default_backend() != "cpu":
      return method(plain)(*args, **kwargs)
    try:
      return method(with_options)(*args, **kwargs)
    except ValueError as e:   # raised while tracing, before anything ran
      if "compiler_options" not in str(e):
        raise
      return method(plain)(*args, **kwargs)

  @functools.wraps(fn)
  def jitted(*args, **kwargs):
    return call(lambda f: f, args, kwargs)

  jitted.lower = lambda *args, **kwargs: call(lambda f: f.lower, args, kwargs)
  # Programs compiled so far, with or without the options (tests count compiles).
  jitted._cache_size = lambda: with_options._cache_size() + plain._cache_size()  # pylint: disable=protected-access
  return jitted
