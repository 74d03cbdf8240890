"""Scan executor: runs lowered tables as one `lax.scan` over ticks inside `shard_map`.

Per tick every rank reads its row of the table, runs its parts with one `lax.switch` (the
branch names the parts: F, I, B, W and packed pairs), and then every rank takes part in the same
`ppermute`s, outside the switch. The backward is explicit: F keeps the leaves of the `jax.vjp`
closure in a residual slot, except leaves that are the stage's own parameters (matched by
identity while tracing), which the backward takes from the live parameters instead. I applies
that closure for the input cotangent, W for the weight cotangent, which is added to the
gradient at once.

The tables are array arguments, not constants, so one compiled program runs any schedule with
the same `ExecSpec` (ranks, chunks per rank, padded ticks and slots, branch set).

In a profiler trace the scan body appears once per branch: ops are named `tick/<branch>/<part>`
(e.g. `tick/F+I/F`, `tick/W/W`); which stage and micro-batch a tick ran is in the lowered
table (`Lowered.to_csv`) and the schedule's own Perfetto trace, indexed by tick.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpipe.pipeline.lower import BRANCHES, CHANNELS, COL, Lowered

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ExecSpec:
  """Static sizes of a compiled executor; tables padded to these share one program."""
  num_ranks: int  # pipeline ranks
  chunks: int  # local chunks (virtual stages) per rank
  num_ticks: int  # scan length
  act_slots: int  # activation arrival slots per rank
  res_slots: int  # residual slots per rank
  cot_slots: int  # output cotangent slots per rank
  branches: tuple[int, ...]  # branch codes (indices into lower.BRANCHES) to compile
  channels: tuple[bool, ...]  # which lower.CHANNELS to ppermute every tick
  recompute: bool = False  # store only stage inputs, recompute the forward in I, B and W

  @classmethod
  def covering(cls, lowered: Sequence[Lowered], recompute: bool = False) -> ExecSpec:
    """The smallest spec that runs every table in `lowered`."""
    if not lowered:
      raise ValueError("need at least one lowered schedule")
    pls = [lo.schedule.placement for lo in lowered]
    for attr in ("num_ranks", "chunks_per_rank"):
      vals = sorted({getattr(pl, attr) for pl in pls})
      if len(vals) > 1:
        raise ValueError(f"schedules disagree on {attr}: {vals}; one program serves one value")
    return cls(
        num_ranks=pls[0].num_ranks, chunks=pls[0].chunks_per_rank,
        num_ticks=max(lo.num_ticks for lo in lowered),
        act_slots=max(lo.act_slots for lo in lowered),
        res_slots=max(lo.res_slots for lo in lowered),
        cot_slots=max(lo.cot_slots for lo in lowered),
        branches=tuple(sorted({0} | {b for lo in lowered for b in lo.branches})),
        channels=tuple(any(lo.channels[i] for lo in lowered) for i in range(len(CHANNELS))),
        recompute=recompute)

  def check(self, lowered: Lowered) -> None:
    pl = lowered.schedule.placement
    problems = []
    if pl.num_ranks != self.num_ranks or pl.chunks_per_rank != self.chunks:
      problems.append(f"{pl.num_ranks} ranks x {pl.chunks_per_rank} chunks, spec has "
                      f"{self.num_ranks} x {self.chunks}")
    for name in ("num_ticks", "act_slots", "res_slots", "cot_slots"):
      if getattr(lowered, name) > getattr(self, name):
        problems.append(f"{name} {getattr(lowered, name)} > {getattr(self, name)}")
    if set(lowered.branches) - set(self.branches):
      problems.append(f"branches {sorted(set(lowered.branches) - set(self.branches))} missing")
    if any(u and not c for u, c in zip(lowered.channels, self.channels)):
      problems.append(f"channels {lowered.channels} not within {self.channels}")
    if problems:
      raise ValueError(f"schedule {lowered.schedule.name!r} does not fit this executor: "
                       + "; ".join(problems) + ". Build the spec with ExecSpec.covering().")


@dataclasses.dataclass(frozen=True)
class Model:
  """What the executor runs; hashable so compiled executors are cached per model."""
  stage_fn: Callable  # (params of one stage, x) -> x of the same shape
  loss_fn: Callable  # (head_params, y, target) -> scalar, on the last stage's output
  embed_fn: Callable | None = None  # (embed_params, xs[mb]) -> x on the first stage; None: xs


def _index(tree: PyTree, i) -> PyTree:
  return jax.tree.map(lambda a: a[i], tree)


def _zeros(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _acc_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass
class _Residuals:
  """How one stage's `jax.vjp` closure splits into stored leaves and live parameters."""
  treedef: Any
  param_of_leaf: tuple[int | None, ...]  # closure leaf -> index of the parameter leaf it is
  stored: tuple[jax.ShapeDtypeStruct, ...]  # the other leaves, in order

  @classmethod
  def probe(cls, stage_fn, params: PyTree, x: jax.ShapeDtypeStruct) -> _Residuals:
    found = {}

    def f(params, x):
      _, vjp_fn = jax.vjp(stage_fn, params, x)
      leaves, treedef = jax.tree.flatten(vjp_fn)
      found["treedef"] = treedef
      found["param_of_leaf"] = _match(leaves, jax.tree.leaves(params))
      return [l for l, j in zip(leaves, found["param_of_leaf"]) if j is None]

    stored = jax.eval_shape(f, params, x)
    return cls(found["treedef"], found["param_of_leaf"],
               tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in stored))

  def split(self, vjp_fn, params: PyTree) -> list[jax.Array]:
    leaves = jax.tree.leaves(vjp_fn)
    got = _match(leaves, jax.tree.leaves(params))
    if got != self.param_of_leaf:
      raise RuntimeError("the stage's vjp closure changed structure between traces; "
                         f"expected parameter leaves at {self.param_of_leaf}, got {got}")
    return [l for l, j in zip(leaves, got) if j is None]

  def join(self, stored: Sequence[jax.Array], params: PyTree):
    live = jax.tree.leaves(params)
    it = iter(stored)
    leaves = [next(it) if j is None else live[j] for j in self.param_of_leaf]
    return jax.tree.unflatten(self.treedef, leaves)


def _match(leaves, param_leaves) -> tuple[int | None, ...]:
  return tuple(next((j for j, q in enumerate(param_leaves) if l is q), None) for l in leaves)


@functools.lru_cache(maxsize=64)
def make_executor(model: Model, spec: ExecSpec, mesh: Mesh, pp_axis: str = "pp",
                  data_axes: tuple[str, ...] | None = None) -> Callable:
  """A jitted `run(table, local_params, xs, targets, head_params, embed_params)`.

  table: int32 [spec.num_ticks, p, len(FIELDS)] (`Lowered.padded`); local_params: leaves
  [p, chunks, ...], rank r's chunk c at [r, c]; xs/targets: [microbatches, batch, ...], the
  batch axis split over `data_axes` (default: every mesh axis but `pp_axis`). Returns
  (loss summed over micro-batches and data shards, local gradients like local_params,
  head_params gradients, embed_params gradients), all reduced over the data axes.
  """
  if pp_axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack the pipeline axis {pp_axis!r}")
  if mesh.shape[pp_axis] != spec.num_ranks:
    raise ValueError(f"the schedule has {spec.num_ranks} ranks but mesh axis {pp_axis!r} has "
                     f"{mesh.shape[pp_axis]} devices; make them equal")
  if data_axes is None:
    data_axes = tuple(a for a in mesh.axis_names if a != pp_axis)
  all_axes = (pp_axis,) + tuple(data_axes)
  p, v = spec.num_ranks, spec.chunks
  batch_spec = P(None, data_axes) if data_axes else P()
  codes = list(spec.branches)
  lut = np.zeros(len(BRANCHES), np.int32)
  for i, code in enumerate(codes):
    lut[code] = i
  perms = {
      "down": [(i, (i + 1) % p) for i in range(p)],
      "up": [(i, (i - 1) % p) for i in range(p)],
  }
  stage_fn, loss_fn, embed_fn = model.stage_fn, model.loss_fn, model.embed_fn

  def body(table, local, xs, targets, head_params, embed_params):
    table = table[:, 0]
    local = _index(local, 0)  # [chunks, ...] on this rank
    chunk0 = _index(local, 0)
    first_in = (lambda mb: embed_fn(embed_params, xs[mb])) if embed_fn else (lambda mb: xs[mb])
    x_sd = jax.eval_shape(first_in, 0)
    x_sd = jax.ShapeDtypeStruct(x_sd.shape, x_sd.dtype)
    y_sd = jax.eval_shape(stage_fn, chunk0, x_sd)
    if (y_sd.shape, y_sd.dtype) != (x_sd.shape, x_sd.dtype):
      raise ValueError(f"stage_fn must keep its input's shape and dtype: {x_sd.shape} "
                       f"{x_sd.dtype} -> {y_sd.shape} {y_sd.dtype}")
    if spec.recompute:
      stored_sd = (x_sd,)
      resid = None
    else:
      resid = _Residuals.probe(stage_fn, chunk0, x_sd)
      stored_sd = resid.stored
    zero_x = jnp.zeros(x_sd.shape, x_sd.dtype)
    zero_params = _zeros(chunk0)
    zero_head = _zeros(head_params)
    zero_embed = _zeros(embed_params)

    def vjp_from(stored, params):
      if spec.recompute:
        return jax.vjp(stage_fn, params, stored[0])[1]
      return resid.join(stored, params)

    def forward(row, act):
      mb = row[COL["f_mb"]]
      params = _index(local, row[COL["f_chunk"]])
      x = lax.cond(row[COL["f_first"]] == 1, lambda: first_in(mb), lambda: act[row[COL["f_in"]]])
      if spec.recompute:
        y, stored = stage_fn(params, x), [x]
      else:
        y, vjp_fn = jax.vjp(stage_fn, params, x)
        stored = resid.split(vjp_fn, params)

      def last():
        target = jax.tree.map(lambda t: t[mb], targets)
        loss, (dhead, dy) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head_params, y, target)
        return loss.astype(jnp.float32), dy, dhead

      loss, dy, dhead = lax.cond(row[COL["f_last"]] == 1, last,
                                 lambda: (jnp.zeros((), jnp.float32), zero_x, zero_head))
      return y, stored, dy, loss, dhead

    def backward(row, res, cot, full: bool):
      params = _index(local, row[COL["b_chunk"]])
      vjp_fn = vjp_from([b[row[COL["b_res"]]] for b in res], params)
      dy = cot[row[COL["b_cot"]]]
      first = row[COL["b_first"]] == 1
      if embed_fn is None:
        # The first stage's input cotangent has no consumer: skip computing it.
        if full:
          dparams, dx = lax.cond(first, lambda: (vjp_fn(dy)[0], zero_x), lambda: vjp_fn(dy))
        else:
          dparams, dx = None, lax.cond(first, lambda: zero_x, lambda: vjp_fn(dy)[1])
        return dx, dparams, zero_embed
      dparams, dx = vjp_fn(dy)
      mb = row[COL["b_mb"]]

      def embed_grad():
        _, embed_vjp = jax.vjp(lambda e: embed_fn(e, xs[mb]), embed_params)
        return embed_vjp(dx)[0]

      dembed = lax.cond(first, embed_grad, lambda: zero_embed)
      return dx, (dparams if full else None), dembed

    def weight(row, res, cot):
      params = _index(local, row[COL["w_chunk"]])
      vjp_fn = vjp_from([b[row[COL["w_res"]]] for b in res], params)
      return vjp_fn(cot[row[COL["w_cot"]]])[0]

    def make_branch(code):
      name = BRANCHES[code]
      parts = () if name == "idle" else tuple(name.split("+"))

      def branch(row, act, res, cot):
        y, stored, dy_last, loss, dhead = (zero_x, [jnp.zeros(s.shape, s.dtype)
                                                    for s in stored_sd], zero_x,
                                           jnp.zeros((), jnp.float32), zero_head)
        dx, dparams, dembed = zero_x, zero_params, zero_embed
        with jax.named_scope(f"tick/{name}"):
          if "F" in parts:
            with jax.named_scope("F"):
              y, stored, dy_last, loss, dhead = forward(row, act)
          for kind in ("I", "B"):
            if kind in parts:
              with jax.named_scope(kind):
                dx, dp, dembed = backward(row, res, cot, full=kind == "B")
              if dp is not None:
                dparams = dp
          if "W" in parts:
            with jax.named_scope("W"):
              dparams = weight(row, res, cot)
        return y, list(stored), dy_last, loss, dhead, dx, dparams, dembed

      return branch

    branches = [make_branch(c) for c in codes]
    lut_arr = jnp.asarray(lut)

    def tick(carry, row):
      act, res, cot, grads, loss, head_g, embed_g = carry
      y, stored, dy_last, dloss, dhead, dx, dparams, dembed = lax.switch(
          lut_arr[row[COL["branch"]]], branches, row, act, res, cot)
      res = [b.at[row[COL["f_res"]]].set(s) for b, s in zip(res, stored)]
      cot = cot.at[row[COL["f_cot"]]].set(dy_last)
      act = act.at[row[COL["f_local"]]].set(y)
      cot = cot.at[row[COL["b_local"]]].set(dx)
      g = row[COL["g_chunk"]]
      grads = jax.tree.map(lambda acc, d: acc.at[g].add(d.astype(acc.dtype)), grads, dparams)
      loss = loss + dloss
      head_g = jax.tree.map(lambda a, d: a + d.astype(a.dtype), head_g, dhead)
      embed_g = jax.tree.map(lambda a, d: a + d.astype(a.dtype), embed_g, dembed)
      # The same collectives on every rank, every tick: a rank with nothing to send sends
      # zeros and its neighbour's table discards them.
      for ch, on in zip(CHANNELS, spec.channels):
        if not on:
          continue
        kind, direction = ch.split("_")
        got = lax.ppermute(y if kind == "act" else dx, pp_axis, perms[direction])
        slot = row[COL[f"recv_{ch}"]]
        if kind == "act":
          act = act.at[slot].set(got)
        else:
          cot = cot.at[slot].set(got)
      return (act, res, cot, grads, loss, head_g, embed_g), None

    # one spare slot at the end of every buffer: -1 in the table writes there harmlessly
    act = jnp.zeros((spec.act_slots + 1,) + x_sd.shape, x_sd.dtype)
    res = [jnp.zeros((spec.res_slots + 1,) + s.shape, s.dtype) for s in stored_sd]
    cot = jnp.zeros((spec.cot_slots + 1,) + x_sd.shape, x_sd.dtype)
    grads = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), local)
    head_g = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), head_params)
    embed_g = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), embed_params)
    carry = (act, res, cot, grads, jnp.zeros((), jnp.float32), head_g, embed_g)
    (_, _, _, grads, loss, head_g, embed_g), _ = lax.scan(tick, carry, table)
    loss = lax.psum(loss, all_axes)
    if data_axes:
      grads = lax.psum(grads, tuple(data_axes))
    head_g = lax.psum(head_g, all_axes)
    embed_g = lax.psum(embed_g, all_axes)
    cast = lambda g, a: g.astype(a.dtype)
    return (loss, jax.tree.map(lambda g, a: cast(g, a)[None], grads, local),
            jax.tree.map(cast, head_g, head_params), jax.tree.map(cast, embed_g, embed_params))

  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(P(None, pp_axis), P(pp_axis), batch_spec, batch_spec, P(), P()),
      out_specs=(P(), P(pp_axis), P(), P()),
      # The carries mix per-rank values with replicated ones and every branch must return
      # the same types; the reductions at the end are explicit, so vma checking is off.
      check_vma=False)

  def run(table, local_params, xs, targets, head_params, embed_params):
    return mapped(table, local_params, xs, targets, head_params, embed_params)

  return jax.jit(run)


def to_local(stage_params: PyTree, layout: np.ndarray) -> PyTree:
  """[stages, ...] -> [ranks, chunks, ...]: each rank's chunks, copies of a stage included."""
  idx = jnp.reshape(layout, (-1,))
  return jax.tree.map(lambda a: a[idx].reshape(tuple(layout.shape) + a.shape[1:]), stage_params)


def from_local(local_grads: PyTree, layout: np.ndarray, num_stages: int) -> PyTree:
  """[ranks, chunks, ...] -> [stages, ...], summing the gradients of a stage's copies."""
  idx = jnp.reshape(layout, (-1,))
  return jax.tree.map(
      lambda g: jnp.zeros((num_stages,) + g.shape[2:], g.dtype).at[idx].add(
          g.reshape((-1,) + g.shape[2:])), local_grads)
