"""Expert-parallel dispatch and combine over one mesh axis, laid out the way DeepEP lays it out.

Runs inside `shard_map`. Each device holds T tokens and E/ep experts. A token chosen by
several experts of one rank travels to that rank once (a (token, rank) *pair*) together
with the ids and weights of its experts there; the rank weights and sums its experts'
outputs, and one row per pair travels back. The layout (pairs per rank and per expert,
each pair's row in the send buffer, which pairs fit) is computed once and read by both
directions, so combine is the exact transpose of dispatch.

Two transports:
  fixed   one `all_to_all` of [ep, capacity, ...] buffers each way; runs everywhere.
          capacity < T drops the pairs that do not fit (counted); capacity = T is dropless.
  ragged  `jax.lax.ragged_all_to_all` of rows packed by destination (GPU/TPU), dropless;
          only the rows that exist cross the wire. 'ragged_emulated' is the same layout
          moved with all_gather, so that the offsets are checked on CPU.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe.ops import fp8 as fp8_lib

IMPLS = ("fixed", "ragged", "ragged_emulated")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static sizes of one dispatch on one device."""

  tokens: int  # T, tokens on this device
  top_k: int  # K, experts per token
  num_experts: int  # E, experts over the whole axis
  ep: int  # size of the expert axis
  capacity: int  # rows one source may send one destination (T: dropless)
  impl: str  # 'fixed', 'ragged' or 'ragged_emulated'

  @property
  def n_local(self) -> int:
    return self.num_experts // self.ep

  @property
  def send_rows(self) -> int:
    if self.impl == "fixed":
      return self.ep * self.capacity
    return self.tokens * min(self.top_k, self.ep)  # a token has at most min(K, ep) pairs

  @property
  def recv_rows(self) -> int:
    return self.ep * self.capacity


def capacity_for(tokens: int, top_k: int, ep: int, capacity_factor: float | None) -> int:
  """Rows one source may send one destination.

  The balanced share `ceil(cf * T * min(K, ep) / ep)`, capped at T (and at least 1).

  Args:
    tokens: T, tokens on this device.
    top_k: K, experts per token.
    ep: size of the expert axis.
    capacity_factor: cf; None: T (dropless).

  Returns:
    The capacity in rows.

  Raises:
    ValueError: `capacity_factor` is not > 0.
  """
  if capacity_factor is None:
    return tokens
  if capacity_factor <= 0:
    raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
  return max(1, min(tokens, math.ceil(capacity_factor * tokens * min(top_k, ep) / ep)))


def make_plan(
    tokens: int,
    top_k: int,
    num_experts: int,
    ep: int,
    capacity_factor: float | None = None,
    impl: str = "fixed",
) -> Plan:
  """The static sizes of one dispatch on one device.

  Args:
    tokens: T, tokens on this device.
    top_k: K, experts per token.
    num_experts: E, experts over the whole expert axis; a multiple of `ep`.
    ep: size of the expert axis.
    capacity_factor: see `capacity_for`; None means dropless.
    impl: the transport, one of `IMPLS`: `'fixed'`, `'ragged'` or `'ragged_emulated'`.

  Returns:
    The `Plan`.

  Raises:
    ValueError: an unknown `impl`, `num_experts` not divisible by `ep`, a capacity factor with a
      ragged (dropless) transport, or a `capacity_factor` that is not > 0.
  """
  if impl not in IMPLS:
    raise ValueError(f"dispatch impl={impl!r} is unknown; use one of {IMPLS}")
  if num_experts % ep:
    raise ValueError(
        f"num_experts={num_experts} is not divisible by the expert axis size ep={ep}; "
        f"use a multiple of {ep} experts or a smaller expert axis"
    )
  if impl != "fixed" and capacity_factor is not None:
    raise ValueError(f"impl={impl!r} is dropless; capacity mode needs impl='fixed'")
  return Plan(
      tokens, top_k, num_experts, ep, capacity_for(tokens, top_k, ep, capacity_factor), impl
  )


class Layout(NamedTuple):
  """Where each (token, choice) goes, DeepEP's `get_dispatch_layout` plus buffer rows."""

  rank_TxK: jax.Array  # destination rank of each choice
  is_token_in_rank_TxR: jax.Array  # token has at least one expert on the rank
  num_tokens_per_rank_R: jax.Array  # pairs per destination, before capacity
  num_tokens_per_expert_E: jax.Array  # assignments per expert
  kept_TxK: jax.Array  # the choice's pair fits in its destination's buffer
  carrier_TxK: jax.Array  # kept, and the first choice of its token on that rank
  send_pos_TxK: jax.Array  # send-buffer row of the choice's pair (send_rows if dropped)
  src_S: jax.Array  # per send row, the carrier choice t*K+k (T*K: empty row)
  send_sizes_R: jax.Array  # rows sent to each destination


def _exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def make_layout(idx_TxK: jax.Array, plan: Plan) -> Layout:
  """Layout of one dispatch from the chosen experts; pure, no communication.

  Pairs are numbered per destination in token order, so a full buffer drops the latest tokens.

  Args:
    idx_TxK: each token's chosen experts, int [T, K], global ids in [0, E).
    plan: the dispatch's static sizes.

  Returns:
    The `Layout`: each choice's destination rank, pair counts per rank and per expert, which
    choices are kept and carry their pair, and the send buffer's rows.
  """
  t, k = idx_TxK.shape
  rank_TxK = idx_TxK // plan.n_local
  in_rank_TxR = jax.nn.one_hot(rank_TxK, plan.ep, dtype=jnp.int32).max(axis=1)
  per_rank_R = in_rank_TxR.sum(0)
  # Pairs are numbered per destination in token order, so overflow drops the latest tokens.
  slot_TxK = jnp.take_along_axis(_exclusive_cumsum(in_rank_TxR), rank_TxK, axis=1)
  kept_TxK = slot_TxK < plan.capacity
  earlier_KxK = jnp.tril(jnp.ones((k, k), bool), -1)
  repeat_TxK = ((rank_TxK[:, :, None] == rank_TxK[:, None, :]) & earlier_KxK).any(-1)
  carrier_TxK = kept_TxK & ~repeat_TxK
  if plan.impl == "fixed":
    base_R = jnp.arange(plan.ep, dtype=jnp.int32) * plan.capacity
    send_sizes_R = jnp.minimum(per_rank_R, plan.capacity)
  else:
    base_R, send_sizes_R = _exclusive_cumsum(per_rank_R), per_rank_R
  s = plan.send_rows
  send_pos_TxK = jnp.where(kept_TxK, base_R[rank_TxK] + slot_TxK, s).astype(jnp.int32)
  src_S = (
      jnp.full((s,), t * k, jnp.int32)
      .at[jnp.where(carrier_TxK, send_pos_TxK, s).ravel()]
      .set(jnp.arange(t * k, dtype=jnp.int32), mode="drop")
  )
  per_expert_E = jnp.zeros((plan.num_experts,), jnp.int32).at[idx_TxK.ravel()].add(1)
  return Layout(
      rank_TxK,
      in_rank_TxR.astype(bool),
      per_rank_R,
      per_expert_E,
      kept_TxK,
      carrier_TxK,
      send_pos_TxK,
      src_S,
      send_sizes_R.astype(jnp.int32),
  )


class Ragged(NamedTuple):
  """Offsets for `ragged_all_to_all` both ways, from an all_gather of the send sizes."""

  input_offsets_R: jax.Array  # where my rows for each destination start in my send buffer
  send_sizes_R: jax.Array
  output_offsets_R: jax.Array  # where my rows land in each destination's receive buffer
  recv_sizes_R: jax.Array  # rows I receive from each source
  recv_offsets_R: jax.Array  # where each source's rows start in my receive buffer
  back_offsets_R: jax.Array  # where my rows came from in each source's send buffer


def ragged_offsets(send_sizes_R: jax.Array, axis: str) -> Ragged:
  """Offsets of a packed dispatch, from an all_gather of the send sizes.

  Rows from source s land after those of sources < s. Runs inside `shard_map`.

  Args:
    send_sizes_R: rows this device sends each destination, int [ep].
    axis: the expert axis.

  Returns:
    The `Ragged` offsets and sizes for `ragged_all_to_all` both ways, each [ep].
  """
  me = jax.lax.axis_index(axis)
  sizes_RxR = jax.lax.all_gather(send_sizes_R, axis)  # [source, destination]
  in_off_RxR = _exclusive_cumsum(sizes_RxR, axis=1)
  out_off_RxR = _exclusive_cumsum(sizes_RxR, axis=0)
  return Ragged(
      in_off_RxR[me],
      send_sizes_R,
      out_off_RxR[me],
      sizes_RxR[:, me],
      out_off_RxR[:, me],
      in_off_RxR[:, me],
  )


def ragged_all_to_all_emulated(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
  """`jax.lax.ragged_all_to_all`'s semantics from all_gather and gathers.

  For backends without `ragged_all_to_all`. Runs inside `shard_map`.

  Args:
    operand: the send buffer, [rows, ...].
    output: the receive buffer, [rows, ...]; its rows that nothing lands on are kept.
    input_offsets: where this device's rows for each destination start in `operand`, [ep].
    send_sizes: rows this device sends each destination, [ep].
    output_offsets: where this device's rows land in each destination's `output`, [ep].
    recv_sizes: rows received from each source, [ep]; unused (implied by the senders' sizes).
    axis_name: the mesh axis.

  Returns:
    `output` with every source's rows written in place.
  """
  del recv_sizes  # implied by the senders' sizes
  me = jax.lax.axis_index(axis_name)
  all_ops = jax.lax.all_gather(operand, axis_name)
  starts = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  froms = jax.lax.all_gather(input_offsets, axis_name)[:, me]
  i = jnp.arange(output.shape[0])
  tail = (1,) * (output.ndim - 1)
  for s in range(all_ops.shape[0]):
    inside = (i >= starts[s]) & (i < starts[s] + sizes[s])
    rows = jnp.clip(froms[s] + i - starts[s], 0, operand.shape[0] - 1)
    output = jnp.where(inside.reshape(-1, *tail), all_ops[s][rows], output)
  return output


@dataclasses.dataclass(frozen=True)
class _Move:
  """One direction of one transport: static parts."""

  plan: Plan
  axis: str | None
  forward: bool  # dispatch direction (send buffer -> receive buffer)


def _move(mv: _Move, x, rg: Ragged | None, fill=0):
  """Moves rows between devices; the receive side's untouched rows hold `fill`."""
  plan = mv.plan
  if mv.axis is None:  # one device: its send buffer is its receive buffer (ep = 1)
    return x
  if plan.impl == "fixed":
    return jax.lax.all_to_all(x, mv.axis, 0, 0, tiled=True)
  rows = plan.recv_rows if mv.forward else plan.send_rows
  out = jnp.full((rows,) + x.shape[1:], fill, x.dtype)
  if mv.forward:
    args = (rg.input_offsets_R, rg.send_sizes_R, rg.output_offsets_R, rg.recv_sizes_R)
  else:
    args = (rg.recv_offsets_R, rg.recv_sizes_R, rg.back_offsets_R, rg.send_sizes_R)
  if plan.impl == "ragged":
    return jax.lax.ragged_all_to_all(x, out, *args, axis_name=mv.axis)
  return ragged_all_to_all_emulated(x, out, *args, axis_name=mv.axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_move(mv: _Move, block: int, x, rg):
  tile = (1, block)  # DeepSeek-V3's activation tiles: one scale per row and `block` channels
  q, scale = fp8_lib.quantize_tiles(x, tile)
  return fp8_lib.dequantize_tiles(_move(mv, q, rg), _move(mv, scale, rg, 1.0), tile, x.dtype)


def _fp8_move_fwd(mv, block, x, rg):
  return _fp8_move(mv, block, x, rg), rg


def _fp8_move_bwd(mv, block, rg, g):
  # DeepEP's split: the payload crosses in e4m3, its gradient in full precision, moved back
  # the other way (a move's transpose is the reverse move); the round trip counts as identity.
  return _move(dataclasses.replace(mv, forward=not mv.forward), g, rg), None


_fp8_move.defvjp(_fp8_move_fwd, _fp8_move_bwd)


class Handle(NamedTuple):
  """What combine reuses from dispatch."""

  layout: Layout
  ragged: Ragged | None


class Received(NamedTuple):
  """One receiving device's rows: a token (once per source pair) and its experts here."""

  x_NxD: jax.Array
  eid_NxK: jax.Array  # local expert ids; n_local marks a choice that is not here, or an empty row
  w_NxK: jax.Array  # combine weights, 0 where eid is n_local


def dispatch(
    x_TxD: jax.Array,
    idx_TxK: jax.Array,
    w_TxK: jax.Array,
    plan: Plan,
    *,
    axis: str | None,
    fp8_block: int | None = None,
) -> tuple[Received, Handle]:
  """Sends each kept (token, rank) pair to its rank with the ids and weights of its experts there.

  Runs inside `shard_map` over `axis`.

  Args:
    x_TxD: this device's tokens, [T, D].
    idx_TxK: each token's chosen experts, int [T, K], global ids.
    w_TxK: their combine weights, [T, K].
    plan: the dispatch's static sizes; must match `idx_TxK`'s shape.
    axis: the expert axis; None on one device (`plan.ep == 1`).
    fp8_block: send the payload in e4m3 with one scale per row and `fp8_block` channels
      (DeepSeek-V3's tiles; its gradient moves back in full precision); None: in `x_TxD`'s dtype.

  Returns:
    The `Received` rows of this device (tokens [N, D], local expert ids [N, K] with `n_local` for
    a choice that is not here or an empty row, weights [N, K]), and the `Handle` that `combine`
    reuses.

  Raises:
    ValueError: `idx_TxK`'s shape does not match the plan, or `plan.ep > 1` without `axis`.
  """
  t, k = idx_TxK.shape
  if (t, k) != (plan.tokens, plan.top_k):
    raise ValueError(
        f"routing of shape {(t, k)} does not match the plan's {(plan.tokens, plan.top_k)}"
    )
  if plan.ep > 1 and axis is None:
    raise ValueError(f"plan.ep={plan.ep} needs the expert axis name")
  layout = make_layout(idx_TxK, plan)
  rg = (
      ragged_offsets(layout.send_sizes_R, axis)
      if plan.impl != "fixed" and axis is not None
      else None
  )
  pair_S = layout.src_S
  x_pad = jnp.concatenate([x_TxD, jnp.zeros((1, x_TxD.shape[1]), x_TxD.dtype)])
  send_x = x_pad[pair_S // k]
  # For each pair: all choices of its token, masked to those on the pair's rank.
  same_TxKxK = layout.rank_TxK[:, :, None] == layout.rank_TxK[:, None, :]
  n_local = plan.n_local
  eid = jnp.where(same_TxKxK, (idx_TxK % n_local)[:, None, :], n_local).reshape(t * k, k)
  w = jnp.where(same_TxKxK, w_TxK[:, None, :], 0.0).reshape(t * k, k)
  send_eid = jnp.concatenate([eid, jnp.full((1, k), n_local, eid.dtype)])[pair_S]
  send_w = jnp.concatenate([w, jnp.zeros((1, k), w.dtype)])[pair_S]
  mv = _Move(plan, axis, True)
  if fp8_block:
    recv_x = _fp8_move(mv, fp8_block, send_x, rg)
  else:
    recv_x = _move(mv, send_x, rg)
  recv = Received(recv_x, _move(mv, send_eid, rg, n_local), _move(mv, send_w, rg))
  return recv, Handle(layout, rg)


def combine(y_NxD: jax.Array, handle: Handle, plan: Plan, *, axis: str | None) -> jax.Array:
  """Returns each pair's row to its token and sums over the token's ranks.

  The exact transpose of `dispatch`'s movement; dropped pairs add 0.

  Args:
    y_NxD: the weighted sum of each received row's experts, [N, D].
    handle: what `dispatch` returned with the rows.
    plan: the dispatch's static sizes.
    axis: the expert axis; None on one device.

  Returns:
    Each token's output, [T, D].
  """
  back_S = _move(_Move(plan, axis, False), y_NxD, handle.ragged)
  back_pad = jnp.concatenate([back_S, jnp.zeros((1, back_S.shape[1]), back_S.dtype)])
  lay = handle.layout
  pos_TxK = jnp.where(lay.carrier_TxK, lay.send_pos_TxK, plan.send_rows)
  return back_pad[pos_TxK].sum(axis=1)
