"""The mesh axes a traced value varies over inside a `shard_map` (its varying-manual-axes type)."""

import jax
from jax import lax


def varying_axes(v) -> frozenset:
  """The mesh axes a traced value varies over inside a `shard_map`.

  Empty outside a `shard_map`, or inside one that does not check varying axes.

  Args:
    v: an array or tracer.

  Returns:
    The names of the manual mesh axes `v` varies over, as a frozenset (empty when none).
  """
  aval = jax.typeof(v)
  mat = getattr(aval, "mat", None)  # JAX 0.10 keeps them here, later versions as `vma`
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(a, like):
  """Casts `a` to vary also over the manual axes `like` varies over.

  Its transpose sums over the added axes.

  Args:
    a: the array to cast.
    like: an array whose varying manual axes `a` should share.

  Returns:
    `a` cast with `lax.pcast(..., to="varying")` over the axes `like` varies over and `a` does
    not; `a` itself when there are none.
  """
  missing = tuple(sorted(varying_axes(like) - varying_axes(a)))
  return lax.pcast(a, missing, to="varying") if missing else a
