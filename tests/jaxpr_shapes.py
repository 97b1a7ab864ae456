"""The shapes a traced program computes, for tests that check what a program holds."""


def shapes(jaxpr):
  """The shapes of every value a jaxpr computes, nested jaxprs (closed or not) included."""
  for eqn in jaxpr.eqns:
    yield from (v.aval.shape for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns"):
          yield from shapes(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          yield from shapes(sub.jaxpr)
