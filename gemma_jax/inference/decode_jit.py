"""`jax.jit` for decoding's programs: on a CPU, compiled without XLA's tree-reduction
rewrite.

A decoded token is a chain of small kernels: at one row every norm, softmax and argmax
reduces a few dozen to a few thousand values, and on a CPU each of XLA's kernels
(thunks) costs microseconds whatever its size. XLA's CPU pipeline splits every
reduction over more than 32 values into a reduce-window and a reduce
(`TreeReductionRewriter`: pairwise-like sums for long float reductions), one more kernel
for each. Without it gemma3-small's greedy `generate` program has 1326 fusions instead
of 1740 and a token takes 2-10% less time (docs/architecture.md, "Decoding without the
tree-reduction rewrite"). Training keeps the rewrite: its step ran 5% slower without it.
The option is CPU-only (another backend's pass of that name is not this one).
"""

import functools

import jax

CPU_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}


def jit(fn, **jit_kwargs):
  """`jax.jit(fn, **jit_kwargs)`, compiled with `CPU_OPTIONS` where JAX's default backend
  is the CPU: called, and lowered with `.lower`, as a jitted function is. Traced inside
  another transformation (its arguments tracers) it is a plain nested `jax.jit`: the
  outer program's compilation decides."""
  with_options = jax.jit(fn, compiler_options=CPU_OPTIONS, **jit_kwargs)
  plain = jax.jit(fn, **jit_kwargs)

  def pick(args, kwargs):
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
    return with_options if jax.default_backend() == "cpu" and not traced else plain

  @functools.wraps(fn)
  def jitted(*args, **kwargs):
    return pick(args, kwargs)(*args, **kwargs)

  jitted.lower = lambda *args, **kwargs: pick(args, kwargs).lower(*args, **kwargs)
  return jitted
