"""Tensor parallelism (Megatron's) over one mesh axis, written as explicit collectives.

Inside `with tensor_parallel("tp"):`, entered within a `shard_map` whose parameters arrive split
by `split_dim` (`param_specs`), the model's layers run Megatron's layout:

  attention   q, k, v column-parallel (this rank's heads; KV heads too, or all of them when
              there are fewer than tp, each rank then using the group of its query heads),
              o row-parallel: a partial sum over this rank's heads, reduced over tp
  MLP         gate and up column-parallel (d_ff / tp), down row-parallel, reduced over tp
  embedding   vocabulary-parallel: each rank looks up the tokens of its vocabulary slice,
              zeros for the others, reduced over tp
  head        vocabulary-parallel logits; the cross-entropy's max, sum of exponentials and
              target logit are reduced over tp, so whole logits are never gathered

Every reduction sits where the layer's output leaves it (`reduce_tokens`): an all-reduce over
tp, or, with sequence parallelism, a reduce-scatter along the sequence, so that norms and the
residual stream between layers hold L/tp tokens and each layer begins with an all-gather along
the sequence (`gather_tokens`). Two all-reduces per layer forward without it; two all-gathers and
two reduce-scatters with it (the same bytes, the norms' and residuals' activations 1/tp).

The backward collectives (Megatron's f and g operators) come from autodiff: inside a
`shard_map` that checks varying axes, a value replicated over tp meeting a split weight is
marked varying, whose transpose is the all-reduce of the input's gradient; the transpose of
the forward all-gather is the backward reduce-scatter.

MoE layers keep their experts split over `ep` and whole over tp: without sequence parallelism
every tp rank routes the same tokens (their experts' gradients are the same on each), with it
each routes its L/tp tokens, and the routing statistics are summed over tp as over the other
token axes (`token_axes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.ops import fp8 as fp8_lib


@dataclasses.dataclass(frozen=True)
class _Placement:
  axis: str
  sequence_parallel: bool


_TP: contextvars.ContextVar[_Placement | None] = contextvars.ContextVar(
    "tensor_parallel", default=None
)


@contextlib.contextmanager
def tensor_parallel(axis_name: str | None = "tp", sequence_parallel: bool = False):
  """While tracing inside, the layers split over `axis_name`.

  Enter it within a `shard_map` whose parameters arrive split by `split_dim` (`param_specs`).
  FP8 projections take their per-tensor scales from amaxes reduced over the axis
  (`fp8.amax_over`), as for the whole tensors.

  Args:
    axis_name: the tensor-parallel mesh axis; None: one device's layers.
    sequence_parallel: the residual stream between layers (and the embedding's output) holds
      this rank's contiguous L/tp slice of every sequence.
  """
  token = _TP.set(None if axis_name is None else _Placement(axis_name, sequence_parallel))
  try:
    with fp8_lib.amax_over(() if axis_name is None else (axis_name,)):
      yield
  finally:
    _TP.reset(token)


def tensor_axis() -> str | None:
  """The axis layers are split over while tracing inside `tensor_parallel`, else None."""
  placement = _TP.get()
  return None if placement is None else placement.axis


def sequence_parallel() -> bool:
  """Whether the residual stream is split along the sequence over `tensor_axis()`."""
  placement = _TP.get()
  return placement is not None and placement.sequence_parallel


def size() -> int:
  """Ranks of the tensor axis (1 outside `tensor_parallel`)."""
  axis = tensor_axis()
  return 1 if axis is None else lax.axis_size(axis)


def token_split() -> int:
  """How many ways the residual stream's sequence is split over the tensor axis."""
  return size() if sequence_parallel() else 1


def gather_tokens(x_BxSxD: jax.Array) -> jax.Array:
  """A layer's input: with sequence parallelism, the whole sequence from every rank's slice.

  Args:
    x_BxSxD: the residual stream as this rank holds it, [B, L/tp, D] with sequence parallelism,
      else [B, L, D].

  Returns:
    [B, L, D]: all-gathered along the sequence with sequence parallelism, else `x_BxSxD` as is.
  """
  if not sequence_parallel():
    return x_BxSxD
  return lax.all_gather(x_BxSxD, tensor_axis(), axis=1, tiled=True)


def reduce_tokens(y_BxLxD: jax.Array) -> jax.Array:
  """A row-parallel layer's partial output summed over the tensor axis.

  All-reduced, or with sequence parallelism reduce-scattered to this rank's slice of the
  sequence. Outside `tensor_parallel` it is returned as is.

  Args:
    y_BxLxD: this rank's partial sum, [B, L, D].

  Returns:
    The sum over the tensor axis, [B, L, D], or [B, L/tp, D] with sequence parallelism.
  """
  axis = tensor_axis()
  if axis is None:
    return y_BxLxD
  if sequence_parallel():
    return lax.psum_scatter(y_BxLxD, axis, scatter_dimension=1, tiled=True)
  return lax.psum(y_BxLxD, axis)


def kv_split(n_kv_heads: int, tp: int) -> bool:
  """Whether the KV heads split over tp ranks (else every rank holds all of them).

  Args:
    n_kv_heads: the model's KV heads.
    tp: tensor-parallel ranks.

  Returns:
    True when `tp` divides `n_kv_heads`.
  """
  return n_kv_heads % tp == 0


def local_heads(n_heads: int, n_kv_heads: int) -> tuple[int, int]:
  """The query and KV heads this rank projects.

  Args:
    n_heads: the model's query heads.
    n_kv_heads: the model's KV heads.

  Returns:
    `(n_heads // tp, n_kv_heads // tp)`, or `(n_heads // tp, n_kv_heads)` when the KV heads do
    not split over tp.
  """
  tp = size()
  return n_heads // tp, n_kv_heads // tp if kv_split(n_kv_heads, tp) else n_kv_heads


def kv_group(kv_BxLxGxK: jax.Array, n_heads: int, n_kv_heads: int) -> jax.Array:
  """The KV heads this rank's query heads read.

  All of them when they split over tp; else the one group of this rank's contiguous query heads
  (tp a multiple of n_kv_heads).

  Args:
    kv_BxLxGxK: keys or values as this rank projects them, [B, L, G, K].
    n_heads: the model's query heads.
    n_kv_heads: the model's KV heads.

  Returns:
    `kv_BxLxGxK` as is, or its one KV head for this rank, [B, L, 1, K].
  """
  tp = size()
  if tp == 1 or kv_split(n_kv_heads, tp):
    return kv_BxLxGxK
  group = lax.axis_index(tensor_axis()) // (tp // n_kv_heads)
  return lax.dynamic_slice_in_dim(kv_BxLxGxK, group, 1, axis=2)


def vocab_embed(table_VpxD: jax.Array, tokens_BxL: jax.Array) -> jax.Array:
  """Embedding lookup with the table's rows split over the tensor axis.

  Each rank looks up the tokens of its vocabulary slice, zeros for the others, and the result is
  reduced over the axis (`reduce_tokens`).

  Args:
    table_VpxD: this rank's rows of the embedding table, [V/tp, D].
    tokens_BxL: token ids, [B, L], over the whole vocabulary.

  Returns:
    The embeddings, [B, L, D], or [B, L/tp, D] with sequence parallelism.
  """
  axis = tensor_axis()
  if axis is None:
    return jnp.take(table_VpxD, tokens_BxL, axis=0)
  rows = table_VpxD.shape[0]
  local_BxL = tokens_BxL - lax.axis_index(axis) * rows
  mine_BxL = (local_BxL >= 0) & (local_BxL < rows)
  x_BxLxD = jnp.take(table_VpxD, jnp.clip(local_BxL, 0, rows - 1), axis=0)
  return reduce_tokens(jnp.where(mine_BxL[..., None], x_BxLxD, 0))


def vocab_cross_entropy(
    logits_BxLxVp: jax.Array, targets_BxL: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Log-partition and target logit of logits whose vocabulary is split over the tensor axis.

  Computed from three reductions of [B, L] (a max, a sum of exponentials, the target's logit), so
  whole logits are never gathered. No gradient flows through the max.

  Args:
    logits_BxLxVp: this rank's slice of the logits, [B, L, V/tp].
    targets_BxL: target ids, [B, L], over the whole vocabulary.

  Returns:
    `(logz_BxL, target_BxL)`: the log-sum-exp over the whole vocabulary and the target's logit,
    each [B, L].
  """
  axis = tensor_axis()
  if axis is None:
    logz_BxL = jax.nn.logsumexp(logits_BxLxVp, axis=-1)
    return logz_BxL, jnp.take_along_axis(logits_BxLxVp, targets_BxL[..., None], axis=-1)[..., 0]
  cols = logits_BxLxVp.shape[-1]
  # the max only keeps exp() in range: any value works, so no gradient flows through it
  max_BxL = lax.pmax(lax.stop_gradient(jnp.max(logits_BxLxVp, axis=-1)), axis)
  sum_BxL = lax.psum(jnp.sum(jnp.exp(logits_BxLxVp - max_BxL[..., None]), axis=-1), axis)
  local_BxL = targets_BxL - lax.axis_index(axis) * cols
  mine_BxL = (local_BxL >= 0) & (local_BxL < cols)
  picked_BxL = jnp.take_along_axis(
      logits_BxLxVp, jnp.clip(local_BxL, 0, cols - 1)[..., None], axis=-1
  )[..., 0]
  target_BxL = lax.psum(jnp.where(mine_BxL, picked_BxL, 0.0), axis)
  return max_BxL + jnp.log(sum_BxL), target_BxL


# Which axis of each split weight runs over the tensor axis, counted from the end (the leading
# layer axes vary): the key names are the model's (jaxpipe.models.transformer).
_SPLIT_DIM = {
    ("attn", "q", "kernel"): -2,  # [D, H, K]: heads
    ("attn", "k", "kernel"): -2,  # [D, G, K]: KV heads, when they split
    ("attn", "v", "kernel"): -2,
    ("attn", "o", "kernel"): -3,  # [H, K, D]: heads
    ("attn", "q", "bias"): -2,  # [H, K]: heads (the o and down biases, [D], stay whole:
    ("attn", "k", "bias"): -2,  # they are added once, after the reduction over tp)
    ("attn", "v", "bias"): -2,
    ("mlp", "gate", "kernel"): -1,  # [D, F]
    ("mlp", "up", "kernel"): -1,
    ("mlp", "gate", "bias"): -1,  # [F]
    ("mlp", "up", "bias"): -1,
    ("mlp", "down", "kernel"): -2,  # [F, D]
    ("embed",): -2,  # [V, D]: vocabulary
    ("head",): -1,  # [D, V]: vocabulary
}


def split_dim(keys: tuple, shape: tuple[int, ...], tp: int) -> int | None:
  """The axis (from the end) of a model parameter split over tp ranks.

  KV projections stay whole when their heads do not divide over tp (`kv_split`); everything not
  named in the split table (norms, routers, experts, fp8 scales) stays whole.

  Args:
    keys: the parameter's path of dict keys (non-string entries are ignored).
    shape: the parameter's shape.
    tp: tensor-parallel ranks.

  Returns:
    The split axis as a negative index, or None if the parameter stays whole (always when
    `tp == 1`).
  """
  if tp == 1:
    return None
  keys = tuple(k for k in keys if isinstance(k, str))
  dim = _SPLIT_DIM.get(keys[-3:]) if len(keys) >= 3 else None
  if dim is None and len(keys) == 1:
    dim = _SPLIT_DIM.get(keys)
  if dim is None or len(shape) < -dim:
    return None
  if keys[-3:-1] in (("attn", "k"), ("attn", "v")) and not kv_split(shape[dim], tp):
    return None
  return dim


def param_specs(params, axis: str, tp: int):
  """PartitionSpecs of a model parameter tree for tensor parallelism.

  Megatron's dims (`split_dim`) are split over `axis` of tp ranks, every other dim whole.

  Args:
    params: the model's parameter tree (arrays or shapes).
    axis: the tensor-parallel mesh axis.
    tp: its ranks.

  Returns:
    A tree of `PartitionSpec`s of the same structure.
  """

  def spec(path, leaf):
    keys = tuple(getattr(k, "key", None) for k in path)
    dim = split_dim(keys, leaf.shape, tp)
    if dim is None:
      return P()
    return P(*([None] * (leaf.ndim + dim)), axis)

  return jax.tree_util.tree_map_with_path(spec, params)


def check(
    *,
    tp: int,
    n_heads: int,
    n_kv_heads: int,
    d_ff: int,
    vocab: int,
    seq_len: int,
    sequence_parallel: bool,
    cp: int = 1,
    over: str | None = None,
    fix: str | None = None,
    kv_whole: bool = True,
) -> None:
  """Checks that the model splits over tp ranks.

  Args:
    tp: tensor-parallel ranks.
    n_heads: the model's query heads.
    n_kv_heads: the model's KV heads.
    d_ff: the MLP's width.
    vocab: the vocabulary size.
    seq_len: the sequence as a context rank holds it (L / cp).
    sequence_parallel: whether the residual stream splits along the sequence over tp.
    cp: context-parallel (Ulysses) ranks.
    over: what the ranks are, for the message; default `'mesh.tp=N'`.
    fix: the remedy for a width that does not split, a format string of `value` (and `name`,
      `tp`); default: a tp dividing it, or a multiple of tp.
    kv_whole: KV heads may stay whole on each rank when fewer than tp (training's rule); the
      serving engine's pools split by KV head, so it passes False.

  Raises:
    ValueError: naming the value and the fix, unless the model splits over tp ranks (and its
      heads per tensor rank over cp ranks).
  """
  over = over or f"mesh.tp={tp}"
  if tp == 1:
    if sequence_parallel:
      raise ValueError(
          "model.sequence_parallel=True splits the sequence over the tensor axis, which has "
          "one rank; set mesh.tp > 1 or model.sequence_parallel=False"
      )
    return
  widths = (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_ff", d_ff), ("vocab", vocab))
  for name, value in widths:
    if value % tp and (name != "n_kv_heads" or not kv_whole):
      remedy = fix or "use a tp that divides {value}, or a {name} that is a multiple of {tp}"
      raise ValueError(
          f"model.{name}={value} does not split over {over}; "
          + remedy.format(value=value, name=name, tp=tp)
      )
  if not kv_split(n_kv_heads, tp) and tp % n_kv_heads:
    raise ValueError(
        f"model.n_kv_heads={n_kv_heads} neither splits over mesh.tp={tp} nor divides it "
        f"(each rank's query heads must read one KV group); use a tp that divides or is a "
        f"multiple of {n_kv_heads}"
    )
  if (n_heads // tp) % cp:
    raise ValueError(
        f"{n_heads // tp} query heads per tensor rank (model.n_heads={n_heads} / mesh.tp={tp}) "
        f"do not split over mesh.cp={cp} for Ulysses; use tp x cp dividing {n_heads}"
    )
  kv_local = n_kv_heads // tp if kv_split(n_kv_heads, tp) else 1
  if cp > 1 and kv_local % cp:
    raise ValueError(
        f"{kv_local} KV heads per tensor rank (model.n_kv_heads={n_kv_heads}, mesh.tp={tp}) "
        f"do not split over mesh.cp={cp} for Ulysses; use tp x cp dividing {n_kv_heads}"
    )
  if sequence_parallel and seq_len % tp:
    raise ValueError(
        f"model.sequence_parallel=True splits each sequence of {seq_len} tokens (per context "
        f"rank) over mesh.tp={tp}, which does not divide it; use a data.seq_len that is a "
        f"multiple of {tp * cp}, or model.sequence_parallel=False"
    )
