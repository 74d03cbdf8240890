"""The mesh axes a traced value varies over inside a `shard_map` (its varying-manual-axes type)."""
import jax


def varying_axes(v) -> frozenset:
  """Empty outside a `shard_map`, or inside one that does not check varying axes."""
  aval = jax.typeof(v)
  mat = getattr(aval, "mat", None)  # JAX 0.10 keeps them here, later versions as `vma`
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
