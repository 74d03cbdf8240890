"""Scan executor: runs lowered tables as one `lax.scan` over ticks inside `shard_map`.

Per tick every rank reads its row of the table, runs its parts with one `lax.switch` (the
branch names the parts: F, I, B, W and packed pairs), and then every rank takes part in the same
`ppermute`s, outside the switch. Collectives over the other mesh axes may sit inside a stage
(an MoE layer's `all_to_all` over `ep`, a psum over a data axis): the table is indexed by the
pp rank only, so all devices of such a collective, which share their pp rank, read the same row,
take the same branch and reach it at the same tick. Only pp-axis collectives, whose members are
on different rows, must stay outside the switch.

Stage parameters are replicated over the other mesh axes unless `param_specs` shards a leaf
over some of them (experts over `ep`): each device then holds and updates only its slice, the
stage function sees that slice, and the leaf's gradient is reduced over the remaining data axes
only (its shards are different parameters, not copies).

A stage may also report statistics: with `Model.stage_aux` the stage function (a `layered`
stage's layer function) returns `(y, aux)`, a pytree of arrays it computed on the way (e.g. how
many tokens each expert received). F adds each micro-batch's aux into a buffer per local chunk
(per layer for a layered stage), returned after the gradients, unreduced over the data axes:
a stage that already reduced over them reports the same value on every data shard.

The backward is explicit: F keeps the leaves of the `jax.vjp` closure in a residual slot, except
leaves that are the stage's own parameters (matched by identity while tracing) or functions of
the parameters alone (casts, transposes), which the backward takes from, or recomputes from, the
live parameters. I applies that closure for the input cotangent, W for the weight cotangent,
which is added to the gradient at once. For a `layered` stage the closure is kept per layer and
I hands W each layer's output cotangent, so W computes weight cotangents only; for an opaque
stage W re-derives them from the stage's output cotangent (the input-cotangent chain inside the
stage runs again).

Slot buffers hold exactly the lowering's peak counts; a table entry of -1 drops the write.
The tables are array arguments, not constants, so one compiled program runs any schedule with
the same `ExecSpec` (ranks, chunks per rank, padded ticks and slots, branch set).

In a profiler trace the scan body appears once per branch: ops are named `tick/<branch>/<part>`
(e.g. `tick/F+I/F`, `tick/W/W`) in their HLO metadata (`op_name`; GPU traces show it, CPU
traces show the HLO instruction names); which stage and micro-batch a tick ran is in the
lowered table (`Lowered.to_csv`) and the schedule's own Perfetto trace, indexed by tick.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.extend.core
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
  wg_slots: int  # slots for what a split backward's I keeps for its W, per rank
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
        wg_slots=max(lo.wg_slots for lo in lowered),
        branches=tuple(sorted({0} | {b for lo in lowered for b in lo.branches})),
        channels=tuple(any(lo.channels[i] for lo in lowered) for i in range(len(CHANNELS))),
        recompute=recompute)

  def check(self, lowered: Lowered) -> None:
    pl = lowered.schedule.placement
    problems = []
    if pl.num_ranks != self.num_ranks or pl.chunks_per_rank != self.chunks:
      problems.append(f"{pl.num_ranks} ranks x {pl.chunks_per_rank} chunks, spec has "
                      f"{self.num_ranks} x {self.chunks}")
    for name in ("num_ticks", "act_slots", "res_slots", "cot_slots", "wg_slots"):
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
  stage_aux: bool = False  # stage_fn (layer_fn if layered) returns (x, aux); aux summed by F
  # (key path of a stage parameter leaf) -> True where that leaf's gradient is combined by max
  # over micro-batches, data shards and stage copies instead of summed (observed statistics)
  max_grads: Callable | None = None


def combines_by_max(model: Model, path) -> bool:
  """Whether `model` combines the gradient of the stage parameter leaf at `path` by max."""
  return model.max_grads is not None and bool(model.max_grads(path))


def _no_aux(fn: Callable) -> Callable:
  return lambda params, x: (fn(params, x), ())


def with_aux(stage_fn: Callable, stage_aux: bool) -> Callable:
  """The stage function as `(params, x) -> (y, aux)`; a layered stage stacks aux per layer."""
  if isinstance(stage_fn, Layered):
    layer_fn = stage_fn.layer_fn if stage_aux else _no_aux(stage_fn.layer_fn)
    return Layered(layer_fn, has_aux=True)
  return stage_fn if stage_aux else _no_aux(stage_fn)


def _index(tree: PyTree, i) -> PyTree:
  return jax.tree.map(lambda a: a[i], tree)


def _zeros(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _acc_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def _aux_dtype(dtype):
  # counts stay exact integers; floats add up in at least float32
  return dtype if jnp.issubdtype(dtype, jnp.integer) else _acc_dtype(dtype)


class Layered:
  """A stage that runs `layer_fn(params_of_one_layer, x) -> x` over its params' leading axis.

  Called as a stage function it is a `lax.scan` over the layers. The executor also sees the
  layers: a split backward's I then keeps each layer's output cotangent, so W computes only
  weight cotangents instead of redoing the input-cotangent chain through the stage.
  """

  def __init__(self, layer_fn: Callable, has_aux: bool = False):
    self.layer_fn = layer_fn
    self.has_aux = has_aux  # layer_fn returns (x, aux); the stage returns (x, aux per layer)

  def __call__(self, params: PyTree, x):
    if self.has_aux:
      return lax.scan(lambda x, p: self.layer_fn(p, x), x, params)
    return lax.scan(lambda x, p: (self.layer_fn(p, x), None), x, params)[0]

  def __eq__(self, other):
    return (isinstance(other, Layered) and other.layer_fn == self.layer_fn
            and other.has_aux == self.has_aux)

  def __hash__(self):
    return hash((Layered, self.layer_fn, self.has_aux))

  def __repr__(self):
    return f"layered({self.layer_fn!r})"


def layered(layer_fn: Callable) -> Layered:
  """Marks a stage as layers of `layer_fn` (stage params: leaves [layers_per_stage, ...])."""
  return Layered(layer_fn)


@dataclasses.dataclass
class _Residuals:
  """How one function's `jax.vjp` closure splits into what F stores and what B/W rebuild.

  Each closure leaf is one of: a parameter leaf itself (matched by identity while tracing; the
  backward passes the live parameter), derived from the parameters alone (e.g. a weight cast to
  the compute dtype; the backward recomputes it from the live parameters), or stored per
  micro-batch in a residual slot.
  """
  fn: Callable
  x: jax.ShapeDtypeStruct
  treedef: Any
  kinds: tuple[tuple, ...]  # per closure leaf: ("param", j) | ("derived",) | ("stored",)
  stored: tuple[jax.ShapeDtypeStruct, ...]  # the stored leaves, in order

  @classmethod
  def probe(cls, fn, params: PyTree, x: jax.ShapeDtypeStruct, has_aux: bool = False
            ) -> _Residuals:
    """`fn(params, x) -> y`, or `-> (y, aux)` with has_aux."""
    fn = fn if has_aux else _no_aux(fn)
    found = {}

    def f(params, x):
      _, vjp_fn, _ = jax.vjp(fn, params, x, has_aux=True)
      leaves, treedef = jax.tree.flatten(vjp_fn)
      found["treedef"] = treedef
      found["param_of_leaf"] = _match(leaves, jax.tree.leaves(params))
      return leaves

    closed = jax.make_jaxpr(f)(params, x)
    on_x = _depends_on_inputs(closed.jaxpr, range(len(jax.tree.leaves(params)),
                                                  len(closed.jaxpr.invars)))
    kinds, stored = [], []
    for j, dep, out in zip(found["param_of_leaf"], on_x, closed.out_avals):
      if j is not None:
        kinds.append(("param", j))
      elif not dep:
        kinds.append(("derived",))
      else:
        kinds.append(("stored",))
        stored.append(jax.ShapeDtypeStruct(out.shape, out.dtype))
    return cls(fn, x, found["treedef"], tuple(kinds), tuple(stored))

  def split(self, vjp_fn, params: PyTree) -> list[jax.Array]:
    leaves = jax.tree.leaves(vjp_fn)
    got = _match(leaves, jax.tree.leaves(params))
    want = tuple(k[1] if k[0] == "param" else None for k in self.kinds)
    if any(w is not None and g != w for g, w in zip(got, want)) or len(got) != len(want):
      raise RuntimeError("the stage's vjp closure changed structure between traces; "
                         f"expected parameter leaves at {want}, got {got}")
    return [l for l, k in zip(leaves, self.kinds) if k[0] == "stored"]

  def join(self, stored: Sequence[jax.Array], params: PyTree):
    live = jax.tree.leaves(params)
    derived = None
    if any(k[0] == "derived" for k in self.kinds):
      # Only the parameter-derived leaves of this trace are used; XLA drops the rest.
      zeros = jnp.zeros(self.x.shape, self.x.dtype)
      derived = jax.tree.leaves(jax.vjp(self.fn, params, zeros, has_aux=True)[1])
    it = iter(stored)
    leaves = [live[k[1]] if k[0] == "param" else derived[i] if k[0] == "derived" else next(it)
              for i, k in enumerate(self.kinds)]
    return jax.tree.unflatten(self.treedef, leaves)


def _match(leaves, param_leaves) -> tuple[int | None, ...]:
  return tuple(next((j for j, q in enumerate(param_leaves) if l is q), None) for l in leaves)


def _depends_on_inputs(jaxpr, inputs) -> list[bool]:
  """Per output of `jaxpr`: whether it may depend on the input variables at `inputs`."""
  tainted = {jaxpr.invars[i] for i in inputs}
  is_var = lambda v: not isinstance(v, jax.extend.core.Literal)
  for eqn in jaxpr.eqns:
    if any(is_var(v) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return [is_var(v) and v in tainted for v in jaxpr.outvars]


class _StageOps:
  """Forward, input-cotangent (I), weight-cotangent (W) and full backward (B) of one stage.

  `stored` is what F keeps per micro-batch (vjp residuals without the parameters, or just the
  input when recomputing); `g` is what I hands to W (the output cotangent, or per layer).
  `need_dx` (traced bool) is False where the input cotangent has no consumer. `stage_fn` returns
  (y, aux) (`with_aux`); only F keeps aux.
  """

  def __init__(self, stage_fn, params: PyTree, x: jax.ShapeDtypeStruct, recompute: bool):
    self.fn, self.recompute = stage_fn, recompute
    self.layered = isinstance(stage_fn, Layered)
    self.x = x
    self.aux = jax.eval_shape(stage_fn, params, x)[1]
    if self.layered:
      self.num_layers = jax.tree.leaves(params)[0].shape[0]
      one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
      self.resid = _Residuals.probe(stage_fn.layer_fn, one, x, has_aux=True)
      stack = lambda s: jax.ShapeDtypeStruct((self.num_layers,) + s.shape, s.dtype)
      kept = tuple(stack(s) for s in self.resid.stored)
      self.g = stack(x)
    else:
      self.resid = None if recompute else _Residuals.probe(stage_fn, params, x, has_aux=True)
      kept = None if recompute else self.resid.stored
      self.g = x
    self.stored = (x,) if recompute else kept

  def zero_x(self):
    return jnp.zeros(self.x.shape, self.x.dtype)

  # -- forward ---------------------------------------------------------------------------------

  def _layer_residuals(self, params, x):
    """-> (y, (stored, aux stacked per layer))"""
    def body(x, p):
      y, vjp_fn, aux = jax.vjp(self.fn.layer_fn, p, x, has_aux=True)
      return y, (self.resid.split(vjp_fn, p), aux)
    return lax.scan(body, x, params)

  def forward(self, params, x):
    """-> (y, stored, aux)"""
    if self.recompute:
      y, aux = self.fn(params, x)
      return y, [x], aux
    if self.layered:
      y, (stored, aux) = self._layer_residuals(params, x)
      return y, stored, aux
    y, vjp_fn, aux = jax.vjp(self.fn, params, x, has_aux=True)
    return y, self.resid.split(vjp_fn, params), aux

  def _residuals(self, params, stored):
    if self.recompute and self.layered:
      return self._layer_residuals(params, stored[0])[1][0]
    return stored

  def _vjp(self, params, stored):
    if self.recompute:
      return jax.vjp(self.fn, params, stored[0], has_aux=True)[1]
    return self.resid.join(stored, params)

  # -- backward --------------------------------------------------------------------------------

  def _layers_back(self, params, res, dy, need_dx, weights: bool):
    """Reverse over layers 1..L-1 in a scan, layer 0 last so its dx can be skipped."""
    layer = lambda l: (_index(params, l), [r[l] for r in res])
    rest = (jax.tree.map(lambda a: a[1:], params), [r[1:] for r in res])

    def body(g, xs):
      p, r = xs
      dp, dx = self.resid.join(r, p)(g)
      return dx, ((dp, g) if weights else g)

    g0, outs = lax.scan(body, dy, rest, reverse=True)
    p0, r0 = layer(0)
    vjp0 = self.resid.join(r0, p0)
    if weights:
      dp_rest, g_rest = outs
      dp0, dx = lax.cond(need_dx, lambda: vjp0(g0), lambda: (vjp0(g0)[0], self.zero_x()))
      dparams = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), dp0, dp_rest)
    else:
      g_rest, dparams = outs, None
      dx = lax.cond(need_dx, lambda: vjp0(g0)[1], self.zero_x)
    g = jnp.concatenate([g0[None], g_rest])
    return dx, dparams, g

  def input_grad(self, params, stored, dy, need_dx):
    """I: -> (dx, g)"""
    if self.layered:
      dx, _, g = self._layers_back(params, self._residuals(params, stored), dy, need_dx, False)
      return dx, g
    vjp_fn = self._vjp(params, stored)
    return lax.cond(need_dx, lambda: vjp_fn(dy)[1], self.zero_x), dy

  def weight_grad(self, params, stored, g):
    """W: -> dparams"""
    if self.layered:
      def body(_, xs):
        p, r, g_l = xs
        return None, self.resid.join(r, p)(g_l)[0]
      return lax.scan(body, None, (params, self._residuals(params, stored), g))[1]
    return self._vjp(params, stored)(g)[0]

  def full_grad(self, params, stored, dy, need_dx):
    """B: -> (dx, dparams)"""
    if self.layered:
      dx, dparams, _ = self._layers_back(params, self._residuals(params, stored), dy, need_dx,
                                         True)
      return dx, dparams
    vjp_fn = self._vjp(params, stored)
    dparams, dx = lax.cond(need_dx, lambda: vjp_fn(dy), lambda: (vjp_fn(dy)[0], self.zero_x()))
    return dx, dparams


def _put(buf, slot, value):
  """buf[slot] = value; slot -1 (nothing to write) drops the write."""
  return buf.at[jnp.where(slot < 0, buf.shape[0], slot)].set(value, mode="drop")


def param_specs_key(param_specs: PyTree | None) -> tuple | None:
  """A stage's spec pytree (PartitionSpec or None leaves) -> a hashable (treedef, leaves) key."""
  if param_specs is None:
    return None
  leaves, treedef = jax.tree.flatten(param_specs, is_leaf=lambda v: v is None or isinstance(v, P))
  bad = [v for v in leaves if v is not None and not isinstance(v, P)]
  if bad:
    raise TypeError(f"param_specs leaves must be PartitionSpec or None, got {bad[0]!r}")
  return treedef, tuple(P() if v is None else v for v in leaves)


def io_spec(batch_axes: tuple[str, ...], seq_axes: tuple[str, ...]) -> P:
  """Spec of xs/targets leaves [microbatches, batch, seq, ...]: batch and sequence split."""
  return P(None, batch_axes or None, *((seq_axes,) if seq_axes else ()))


def as_axes(axes: str | Sequence[str] | None) -> tuple[str, ...]:
  """A mesh axis name or a sequence of them -> a tuple of names."""
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def data_axes_of(mesh: Mesh, pp_axis: str, data_axes: str | Sequence[str] | None,
                 seq_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes that split the batch: `data_axes`, or by default every mesh axis but the pipeline
  and sequence axes."""
  if data_axes is None:
    return tuple(a for a in mesh.axis_names if a != pp_axis and a not in seq_axes)
  return as_axes(data_axes)


def check_param_specs(param_specs: tuple, data_axes: tuple[str, ...], seq_axes: tuple[str, ...],
                      pp_axis: str, params: PyTree | None = None) -> None:
  """Raises ValueError unless a `param_specs_key` splits leaves over data axes only (and, given
  one stage's params, has their structure)."""
  treedef, leaf_specs = param_specs
  if params is not None and jax.tree.structure(params) != treedef:
    raise ValueError(f"param_specs has structure {treedef} but the stage params have "
                     f"{jax.tree.structure(params)}; give one spec per parameter leaf")
  for leaf_spec in leaf_specs:
    bad = [a for a in _leaf_axes(leaf_spec) if a not in data_axes]
    if bad:
      raise ValueError(f"param_specs entry {leaf_spec} shards over {bad}, which are not "
                       f"data axes {data_axes} of this executor; parameters split over "
                       f"{pp_axis!r} go on the leading [ranks, chunks] axes instead, and "
                       f"sequence axes {seq_axes} hold whole parameters")


def _leaf_axes(spec: P) -> tuple[str, ...]:
  names = []
  for entry in spec:
    names += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
  return tuple(names)


@functools.lru_cache(maxsize=64)
def make_executor(model: Model, spec: ExecSpec, mesh: Mesh, pp_axis: str = "pp",
                  data_axes: tuple[str, ...] | None = None,
                  param_specs: tuple | None = None, seq_axes: tuple[str, ...] = ()) -> Callable:
  """A jitted `run(table, local_params, xs, targets, head_params, embed_params)`.

  table: int32 [spec.num_ticks, p, len(FIELDS)] (`Lowered.padded`); local_params: leaves
  [p, chunks, ...], rank r's chunk c at [r, c]; xs/targets: [microbatches, batch, seq, ...],
  the batch axis split over `data_axes` (default: every mesh axis but `pp_axis` and
  `seq_axes`) and the sequence axis over `seq_axes` (context parallelism: the stage, embedding
  and loss functions then see a slice of every sequence and run their own collectives over
  those axes; a data shard, in what follows, is one slice over data and sequence axes). `param_specs`
  (`param_specs_key` of a pytree like one chunk's params, PartitionSpec leaves over the chunk's
  own dims, None = replicated) shards leaves over data axes. Returns (loss summed over
  micro-batches and data shards, local gradients like local_params, head_params gradients,
  embed_params gradients), each reduced over the data axes its parameter is not sharded over,
  and with `model.stage_aux` the stage aux summed over micro-batches: leaves [p, chunks, data
  shards, ...] (rank r's chunk c as seen by data shard d, ordered over `data_axes` then
  `seq_axes`).
  """
  if pp_axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack the pipeline axis {pp_axis!r}")
  if mesh.shape[pp_axis] != spec.num_ranks:
    raise ValueError(f"the schedule has {spec.num_ranks} ranks but mesh axis {pp_axis!r} has "
                     f"{mesh.shape[pp_axis]} devices; make them equal")
  seq_axes = as_axes(seq_axes)
  batch_axes = data_axes_of(mesh, pp_axis, data_axes, seq_axes)
  both = sorted(set(batch_axes) & set(seq_axes))
  if both or pp_axis in batch_axes + seq_axes:
    raise ValueError(f"data_axes {batch_axes} and seq_axes {seq_axes} must be disjoint and leave "
                     f"out the pipeline axis {pp_axis!r}; drop {both or [pp_axis]} from one")
  # Sequence shards hold different tokens, exactly as data shards do: sums run over both.
  data_axes = batch_axes + seq_axes
  all_axes = (pp_axis,) + data_axes
  leaf_specs = None
  if param_specs is not None:
    specs_treedef, leaf_specs = param_specs
    check_param_specs(param_specs, batch_axes, seq_axes, pp_axis)
  p = spec.num_ranks
  batch_spec = io_spec(batch_axes, seq_axes)
  codes = list(spec.branches)
  lut = np.zeros(len(BRANCHES), np.int32)
  for i, code in enumerate(codes):
    lut[code] = i
  perms = {
      "down": [(i, (i + 1) % p) for i in range(p)],
      "up": [(i, (i - 1) % p) for i in range(p)],
  }
  stage_fn = with_aux(model.stage_fn, model.stage_aux)
  loss_fn, embed_fn = model.loss_fn, model.embed_fn

  def body(table, local, xs, targets, head_params, embed_params):
    table = table[:, 0]
    local = _index(local, 0)  # [chunks, ...] on this rank
    chunk0 = _index(local, 0)
    first_in = (lambda mb: embed_fn(embed_params, xs[mb])) if embed_fn else (lambda mb: xs[mb])
    x_sd = jax.eval_shape(first_in, 0)
    x_sd = jax.ShapeDtypeStruct(x_sd.shape, x_sd.dtype)
    y_sd = jax.eval_shape(stage_fn, chunk0, x_sd)[0]
    if (y_sd.shape, y_sd.dtype) != (x_sd.shape, x_sd.dtype):
      raise ValueError(f"stage_fn must keep its input's shape and dtype: {x_sd.shape} "
                       f"{x_sd.dtype} -> {y_sd.shape} {y_sd.dtype}")
    ops = _StageOps(stage_fn, chunk0, x_sd, spec.recompute)
    zero_x = ops.zero_x()
    zero_params = _zeros(chunk0)
    zero_head = _zeros(head_params)
    zero_embed = _zeros(embed_params)
    zero_g = jnp.zeros(ops.g.shape, ops.g.dtype)
    zero_loss = jnp.zeros((), jnp.float32)
    zero_aux = _zeros(ops.aux)

    def forward(row, act):
      mb = row[COL["f_mb"]]
      params = _index(local, row[COL["f_chunk"]])
      x = lax.cond(row[COL["f_first"]] == 1, lambda: first_in(mb), lambda: act[row[COL["f_in"]]])
      y, stored, aux = ops.forward(params, x)

      def last():
        target = jax.tree.map(lambda t: t[mb], targets)
        loss, (dhead, dy) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head_params, y, target)
        return loss.astype(jnp.float32), dy, dhead

      loss, dy, dhead = lax.cond(row[COL["f_last"]] == 1, last,
                                 lambda: (zero_loss, zero_x, zero_head))
      return y, stored, dy, loss, dhead, aux

    def backward(row, res, cot, full: bool):
      """I or B: -> (dx, dparams or None, g or None, dembed)"""
      params = _index(local, row[COL["b_chunk"]])
      stored = [b[row[COL["b_res"]]] for b in res]
      dy = cot[row[COL["b_cot"]]]
      first = row[COL["b_first"]] == 1
      # The first stage's input cotangent feeds only the embedding, if there is one.
      need_dx = jnp.logical_not(first) if embed_fn is None else jnp.bool_(True)
      if full:
        (dx, dparams), g = ops.full_grad(params, stored, dy, need_dx), None
      else:
        (dx, g), dparams = ops.input_grad(params, stored, dy, need_dx), None
      if embed_fn is None:
        return dx, dparams, g, zero_embed
      mb = row[COL["b_mb"]]

      def embed_grad():
        _, embed_vjp = jax.vjp(lambda e: embed_fn(e, xs[mb]), embed_params)
        return embed_vjp(dx)[0]

      return dx, dparams, g, lax.cond(first, embed_grad, lambda: zero_embed)

    def weight(row, res, wg):
      params = _index(local, row[COL["w_chunk"]])
      return ops.weight_grad(params, [b[row[COL["w_res"]]] for b in res], wg[row[COL["w_wg"]]])

    def make_branch(code):
      name = BRANCHES[code]
      parts = () if name == "idle" else tuple(name.split("+"))

      def branch(row, act, res, cot, wg):
        y, stored, dy_last, loss, dhead, aux = (zero_x, [jnp.zeros(s.shape, s.dtype)
                                                         for s in ops.stored], zero_x,
                                                zero_loss, zero_head, zero_aux)
        dx, dparams, g, dembed = zero_x, zero_params, zero_g, zero_embed
        with jax.named_scope(f"tick/{name}"):
          if "F" in parts:
            with jax.named_scope("F"):
              y, stored, dy_last, loss, dhead, aux = forward(row, act)
          for kind in ("I", "B"):
            if kind in parts:
              with jax.named_scope(kind):
                dx, dp, g_new, dembed = backward(row, res, cot, full=kind == "B")
              dparams = dp if dp is not None else dparams
              g = g_new if g_new is not None else g
          if "W" in parts:
            with jax.named_scope("W"):
              dparams = weight(row, res, wg)
        return y, list(stored), dy_last, loss, dhead, dx, dparams, g, dembed, aux

      return branch

    branches = [make_branch(c) for c in codes]
    lut_arr = jnp.asarray(lut)
    parts_of = [set(BRANCHES[c].split("+")) for c in range(len(BRANCHES))]
    has_f = jnp.asarray(["F" in parts for parts in parts_of])
    # Without a branch that runs F beside I or B, a rank sends at most one of y and dx per
    # tick, so the activation and cotangent channels of one direction can share a ppermute.
    shared_link = not any("F" in parts_of[c] and parts_of[c] & {"I", "B"} for c in codes)

    def tick(carry, row):
      act, res, cot, wg, grads, loss, head_g, embed_g, stats = carry
      y, stored, dy_last, dloss, dhead, dx, dparams, g, dembed, aux = lax.switch(
          lut_arr[row[COL["branch"]]], branches, row, act, res, cot, wg)
      res = [_put(b, row[COL["f_res"]], s) for b, s in zip(res, stored)]
      cot = _put(cot, row[COL["f_cot"]], dy_last)
      act = _put(act, row[COL["f_local"]], y)
      cot = _put(cot, row[COL["b_local"]], dx)
      wg = _put(wg, row[COL["b_wg"]], g)
      c = row[COL["g_chunk"]]
      grads = jax.tree_util.tree_map_with_path(
          lambda path, acc, d: (acc.at[c].max if combines_by_max(model, path) else acc.at[c].add)(
              d.astype(acc.dtype)), grads, dparams)
      loss = loss + dloss
      head_g = jax.tree.map(lambda a, d: a + d.astype(a.dtype), head_g, dhead)
      embed_g = jax.tree.map(lambda a, d: a + d.astype(a.dtype), embed_g, dembed)
      # aux is zero on ticks without F, whatever chunk the row names
      fc = row[COL["f_chunk"]]
      fc = jnp.where(fc < 0, spec.chunks, fc)
      stats = jax.tree.map(lambda acc, a: acc.at[fc].add(a.astype(acc.dtype), mode="drop"),
                           stats, aux)
      # The same collectives on every rank, every tick: a rank with nothing to send sends
      # zeros and its neighbour's table discards them.
      for direction in ("down", "up"):
        on = [kind for kind in ("act", "grad")
              if spec.channels[CHANNELS.index(f"{kind}_{direction}")]]
        if shared_link and len(on) == 2:
          # y and dx going the same way never leave a rank in the same tick: one ppermute.
          got = lax.ppermute(jnp.where(has_f[row[COL["branch"]]], y, dx), pp_axis, perms[direction])
          got = {"act": got, "grad": got}
        else:
          got = {kind: lax.ppermute(y if kind == "act" else dx, pp_axis, perms[direction])
                 for kind in on}
        if "act" in got:
          act = _put(act, row[COL[f"recv_act_{direction}"]], got["act"])
        if "grad" in got:
          cot = _put(cot, row[COL[f"recv_grad_{direction}"]], got["grad"])
      return (act, res, cot, wg, grads, loss, head_g, embed_g, stats), None

    # at least one slot, so that branches reading a buffer trace even when none is used
    slots = lambda n, sd: jnp.zeros((max(n, 1),) + sd.shape, sd.dtype)
    act = slots(spec.act_slots, x_sd)
    res = [slots(spec.res_slots, s) for s in ops.stored]
    cot = slots(spec.cot_slots, x_sd)
    wg = slots(spec.wg_slots, ops.g)
    grads = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), local)
    head_g = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), head_params)
    embed_g = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), embed_params)
    stats = jax.tree.map(lambda a: jnp.zeros((spec.chunks,) + a.shape, _aux_dtype(a.dtype)),
                         ops.aux)
    carry = (act, res, cot, wg, grads, zero_loss, head_g, embed_g, stats)
    (_, _, _, _, grads, loss, head_g, embed_g, stats), _ = lax.scan(tick, carry, table)
    loss = lax.psum(loss, all_axes)
    # A sharded leaf's slices are different parameters: sum only over the axes it is copied on.
    flat, grads_treedef = jax.tree_util.tree_flatten_with_path(grads)
    reduced = []
    for i, (path, g) in enumerate(flat):
      axes = tuple(data_axes) if leaf_specs is None else tuple(
          a for a in data_axes if a not in _leaf_axes(leaf_specs[i]))
      reduce = lax.pmax if combines_by_max(model, path) else lax.psum
      reduced.append(reduce(g, axes) if axes else g)
    grads = jax.tree.unflatten(grads_treedef, reduced)
    head_g = lax.psum(head_g, all_axes)
    embed_g = lax.psum(embed_g, all_axes)
    cast = lambda g, a: g.astype(a.dtype)
    out = (loss, jax.tree.map(lambda g, a: cast(g, a)[None], grads, local),
           jax.tree.map(cast, head_g, head_params), jax.tree.map(cast, embed_g, embed_params))
    if model.stage_aux:
      out += (jax.tree.map(lambda a: a[None, :, None], stats),)
    return out

  local_spec = P(pp_axis)
  if leaf_specs is not None:
    local_spec = jax.tree.unflatten(specs_treedef, [P(pp_axis, None, *ls) for ls in leaf_specs])
  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(P(None, pp_axis), local_spec, batch_spec, batch_spec, P(), P()),
      out_specs=(P(), local_spec, P(), P())
      + ((P(pp_axis, None, data_axes or None),) if model.stage_aux else ()),
      # The carries mix per-rank values with replicated ones and every branch must return
      # the same types; the reductions at the end are explicit, so vma checking is off.
      check_vma=False)

  def run(table, local_params, xs, targets, head_params, embed_params):
    if param_specs is not None:
      check_param_specs(param_specs, batch_axes, seq_axes, pp_axis, local_params)
    return mapped(table, local_params, xs, targets, head_params, embed_params)

  return jax.jit(run)


def is_contiguous(layout) -> bool:
  """Whether rank r's chunks are model stages r·v .. r·v+v-1 in order (no copies): a reshape."""
  if not isinstance(layout, np.ndarray):
    return False
  return bool(np.array_equal(layout, np.arange(layout.size).reshape(layout.shape)))


def to_local(stage_params: PyTree, layout: np.ndarray) -> PyTree:
  """[stages, ...] -> [ranks, chunks, ...]: each rank's chunks, copies of a stage included.

  A contiguous numpy layout is a reshape, so a stage stack already split over the pipeline axis
  stays in place; any other layout (or a traced one) is a gather, for which XLA moves the
  stages to their ranks.
  """
  if is_contiguous(layout):
    return jax.tree.map(lambda a: a.reshape(tuple(layout.shape) + a.shape[1:]), stage_params)
  idx = jnp.reshape(layout, (-1,))
  return jax.tree.map(lambda a: a[idx].reshape(tuple(layout.shape) + a.shape[1:]), stage_params)


def from_local(local_grads: PyTree, layout: np.ndarray, num_stages: int,
               model: Model | None = None) -> PyTree:
  """[ranks, chunks, ...] -> [stages, ...], summing the gradients of a stage's copies (or taking
  their max, for the leaves `model` combines by max)."""
  if is_contiguous(layout) and layout.size == num_stages:
    return jax.tree.map(lambda g: g.reshape((num_stages,) + g.shape[2:]), local_grads)
  idx = jnp.reshape(layout, (-1,))

  def gather(path, g):
    out = jnp.zeros((num_stages,) + g.shape[2:], g.dtype).at[idx]
    by_max = model is not None and combines_by_max(model, path)
    return (out.max if by_max else out.add)(g.reshape((-1,) + g.shape[2:]))

  return jax.tree_util.tree_map_with_path(gather, local_grads)
