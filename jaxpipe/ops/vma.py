"""The mesh axes a traced value varies over inside a `shard_map` (its varying-manual-axes type)."""

import jax
from jax import lax


def varying_axes(v) -> frozenset:
  """Empty outside a `shard_map`, or inside one that does not check varying axes."""
  aval = jax.typeof(v)
  mat = getattr(aval, "mat", None)  # JAX 0.10 keeps them here, later versions as `vma`
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(a, like):
  """`a` cast to vary also over the manual axes `like` varies over
  (its transpose sums over them)."""
  missing = tuple(sorted(varying_axes(like) - varying_axes(a)))
  return lax.pcast(a, missing, to="varying") if missing else a
