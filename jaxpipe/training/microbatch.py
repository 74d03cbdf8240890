"""Micro-batches: a batch split into slices, and gradients summed over them (accumulation).

Row i·m + j of a batch goes to micro-batch j, a reshape that keeps the batch axis's sharding
(each data rank's rows stay on it), so every parallel path splits the same way.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpipe.ops import fp8 as fp8_lib


def split(batch: Any, microbatches: int) -> Any:
  """A batch tree's leaves [B, ...] as [microbatches, B / microbatches, ...].

  Args:
    batch: a tree of arrays whose leading axis is the batch (B rows).
    microbatches: m, which divides B.

  Returns:
    The same tree, each leaf [m, B / m, ...] with row i·m + j of the batch at [j, i].
  """
  m = microbatches
  return jax.tree.map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch
  )


def accumulate(fn: Callable, params: Any, batch: Any, microbatches: int, *args: Any) -> Any:
  """`fn(params, micro_batch, *args)` summed over the batch's micro-batches by one `lax.scan`.

  Args:
    fn: returns a tree of sums (a loss sum, token counts, gradients, auxiliary sums); FP8
      state leaves (observed amaxes) are combined by max, as `fp8.accumulate` does.
    params: passed to every call unchanged.
    batch: a tree of arrays [B, ...] (`split`).
    microbatches: the number of slices; 1 calls `fn` once on the whole batch.
    *args: passed to every call after the micro-batch.

  Returns:
    `fn`'s output tree, summed over the micro-batches.
  """
  if microbatches == 1:
    return fn(params, batch, *args)
  slices = split(batch, microbatches)

  def body(carry, mb):
    return fp8_lib.accumulate(carry, fn(params, mb, *args)), None

  first = jax.tree.map(lambda x: x[0], slices)
  shapes = jax.eval_shape(fn, params, first, *args)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.lax.scan(body, zeros, slices)[0]
