"""Scan executor: runs lowered tables as one `lax.scan` over ticks inside `shard_map`.

Per tick every rank reads its row of the table and runs the parts it names (W, then I or B,
then F: readers of a slot before its next writer), each only where the row asks for it, and
then every rank takes part in the same `ppermute`s, outside the parts. A part reads its inputs
from the rank's slot buffers and writes its outputs into them in place, so a tick costs what its
parts compute and move. The backward is explicit: F keeps the `jax.vjp` closure's leaves in a
residual slot (less the parameters and what derives from them alone), I applies it for the
input cotangent and W for the weight cotangent; a `layered` stage's layer backward is split
once into those two halves (`split_backward`), so I and W together cost one backward.

The tables are array arguments, not constants: one compiled program runs any schedule with the
same `ExecSpec`. The parts are named `tick/F`, `tick/I`, `tick/B`, `tick/W` in profiler traces.
Collectives inside a stage, sharded parameters (`PipelineSharding`), stage statistics
(`Model.stage_aux`) and per-micro-batch side inputs (`Model.side_inputs`): docs/schedules.md,
"The executor".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.pipeline.ir.lower import BRANCHES, CHANNELS, COL, Lowered
from jaxpipe.pipeline.sharding import PipelineSharding, as_sharding
from jaxpipe.pipeline.split_backward import split_backward

PARTS = ("F", "I", "B", "W")  # the parts a branch may run in one tick
LOCAL_FIELDS = ("f_local", "b_local")  # table columns of same-rank moves (ExecSpec.local_moves)

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
  # whether some table moves a value between two stages of one rank (V shapes): an F's output
  # to the same rank's next stage (f_local), an I's or B's input cotangent (b_local); without
  # such moves the executor compiles no per-tick step for them
  local_moves: tuple[bool, bool] = (True, True)

  @classmethod
  def covering(cls, lowered: Sequence[Lowered], recompute: bool = False) -> ExecSpec:
    """The smallest spec that runs every table in `lowered`.

    Args:
      lowered: the lowered schedules the program is to run; they must agree on the number of
        ranks and chunks per rank.
      recompute: store only stage inputs and recompute the forward in I, B and W.

    Returns:
      The `ExecSpec`: the shared ranks and chunks, the largest tick and slot counts, and the union
      of branches, channels and same-rank moves.

    Raises:
      ValueError: `lowered` is empty, or its schedules disagree on `num_ranks` or
        `chunks_per_rank` (one program serves one value).
    """
    if not lowered:
      raise ValueError("need at least one lowered schedule")
    pls = [lo.schedule.placement for lo in lowered]
    for attr in ("num_ranks", "chunks_per_rank"):
      vals = sorted({getattr(pl, attr) for pl in pls})
      if len(vals) > 1:
        raise ValueError(f"schedules disagree on {attr}: {vals}; one program serves one value")
    return cls(
        num_ranks=pls[0].num_ranks,
        chunks=pls[0].chunks_per_rank,
        num_ticks=max(lo.num_ticks for lo in lowered),
        act_slots=max(lo.act_slots for lo in lowered),
        res_slots=max(lo.res_slots for lo in lowered),
        cot_slots=max(lo.cot_slots for lo in lowered),
        wg_slots=max(lo.wg_slots for lo in lowered),
        branches=tuple(sorted({0} | {b for lo in lowered for b in lo.branches})),
        channels=tuple(any(lo.channels[i] for lo in lowered) for i in range(len(CHANNELS))),
        recompute=recompute,
        local_moves=tuple(
            any(bool(np.any(lo.table[..., COL[f]] >= 0)) for lo in lowered) for f in LOCAL_FIELDS
        ),
    )

  def check(self, lowered: Lowered) -> None:
    """Checks that this spec runs the table of `lowered`.

    Args:
      lowered: a lowered schedule.

    Raises:
      ValueError: its ranks or chunks differ from the spec's, or its ticks, slots, branches,
        channels or same-rank moves exceed it; the message lists every problem and points to
        `ExecSpec.covering()`.
    """
    pl = lowered.schedule.placement
    problems = []
    if pl.num_ranks != self.num_ranks or pl.chunks_per_rank != self.chunks:
      problems.append(
          f"{pl.num_ranks} ranks x {pl.chunks_per_rank} chunks, spec has "
          f"{self.num_ranks} x {self.chunks}"
      )
    for name in ("num_ticks", "act_slots", "res_slots", "cot_slots", "wg_slots"):
      if getattr(lowered, name) > getattr(self, name):
        problems.append(f"{name} {getattr(lowered, name)} > {getattr(self, name)}")
    if set(lowered.branches) - set(self.branches):
      problems.append(f"branches {sorted(set(lowered.branches) - set(self.branches))} missing")
    if any(u and not c for u, c in zip(lowered.channels, self.channels)):
      problems.append(f"channels {lowered.channels} not within {self.channels}")
    for f, on in zip(LOCAL_FIELDS, self.local_moves):
      if not on and np.any(lowered.table[..., COL[f]] >= 0):
        problems.append(f"the table moves values within a rank ({f}), the spec does not")
    if problems:
      raise ValueError(
          f"schedule {lowered.schedule.name!r} does not fit this executor: "
          + "; ".join(problems)
          + ". Build the spec with ExecSpec.covering()."
      )


@dataclasses.dataclass(frozen=True)
class Model:
  """What the executor runs; hashable so compiled executors are cached per model."""

  stage_fn: Callable  # (params of one stage, x) -> x of the same shape
  loss_fn: Callable  # (head_params, y, target) -> scalar, on the last stage's output
  embed_fn: Callable | None = None  # (embed_params, xs[mb]) -> x on the first stage; None: xs
  stage_aux: bool = False  # stage_fn (layer_fn if layered) returns (x, aux); aux summed by F
  # stage_fn (layer_fn if layered) takes (params, x, side): side is one micro-batch's slice of
  # the side inputs (docs/schedules.md, "The executor"), not differentiated
  side_inputs: bool = False
  # (key path of a stage parameter leaf) -> True where that leaf's gradient is combined by max
  # over micro-batches, data shards and stage copies instead of summed (observed statistics)
  max_grads: Callable | None = None
  # a layered stage's layer function takes a last argument, the layer's index in the model
  # (its model stage x layers per stage + its place in the stage; traced), for layers that
  # differ by their place (sliding-window and full-attention layers)
  unit_index: bool = False


def combines_by_max(model: Model | None, path) -> bool:
  """Whether `model` combines the gradient of the stage parameter leaf at `path` by max.

  Args:
    model: the model whose `Model.max_grads` decides, or None.
    path: the key path of a stage parameter leaf.

  Returns:
    True where `model.max_grads(path)` says so; False without a model or `max_grads`.
  """
  return model is not None and model.max_grads is not None and bool(model.max_grads(path))


def _no_aux(fn: Callable) -> Callable:
  return lambda params, x: (fn(params, x), ())


def _uniform(fn: Callable, has_aux: bool, side_inputs: bool) -> Callable:
  """fn as `(params, x, side) -> (y, aux)`: aux () without has_aux, side dropped unless used."""
  if side_inputs:
    return fn if has_aux else lambda params, x, side: (fn(params, x, side), ())
  return (
      (lambda params, x, side: fn(params, x))
      if has_aux
      else (lambda params, x, side: (fn(params, x), ()))
  )


def with_aux(
    stage_fn: Callable, stage_aux: bool, side_inputs: bool = False, unit_index: bool = False
) -> Callable:
  """The stage function as `(params, x, side) -> (y, aux)`; a layered stage stacks aux per layer.

  `side` is one micro-batch's side inputs, passed on only with `side_inputs`. With `unit_index`
  (a layered stage) side is `(side, index)` instead: the index of the stage's first layer in the
  model for the stage, of the layer itself for its layer function, which gets it as its last
  argument.

  Args:
    stage_fn: the stage function, or a `Layered` stage.
    stage_aux: whether `stage_fn` (its layer function, if layered) returns `(y, aux)`
      (`Model.stage_aux`); without it aux is `()`.
    side_inputs: whether it takes the side inputs as a third argument (`Model.side_inputs`).
    unit_index: whether a layered stage's layer function takes its layer's index in the model
      last (`Model.unit_index`).

  Returns:
    The function `(params, x, side) -> (y, aux)`; for a layered stage a `Layered` whose layer
    function has that form and which returns aux stacked per layer.
  """
  if isinstance(stage_fn, Layered):
    if unit_index:
      fn = _indexed(stage_fn.layer_fn, stage_aux, side_inputs)
    else:
      fn = _uniform(stage_fn.layer_fn, stage_aux, side_inputs)
    return Layered(fn, has_aux=True, indexed=unit_index)
  return _uniform(stage_fn, stage_aux, side_inputs)


def _indexed(fn: Callable, has_aux: bool, side_inputs: bool) -> Callable:
  """A layer function taking `index` last as `(params, x, (side, index)) -> (y, aux)`."""

  def call(params, x, side_index):
    side, index = side_index
    out = fn(params, x, side, index) if side_inputs else fn(params, x, index)
    return out if has_aux else (out, ())

  return call


def _index(tree: PyTree, i) -> PyTree:
  return jax.tree.map(lambda a: a[i], tree)


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

  def __init__(self, layer_fn: Callable, has_aux: bool = False, indexed: bool = False):
    self.layer_fn = layer_fn
    self.has_aux = has_aux  # layer_fn returns (x, aux); the stage returns (x, aux per layer)
    # side is (side, index): the stage's first layer's index, which each layer's grows by one
    self.indexed = indexed

  def __call__(self, params: PyTree, x, *side):
    """side: the side inputs, when the layer function takes them (`Model.side_inputs`)."""
    fn = self.layer_fn if self.has_aux else lambda p, x, *s: (self.layer_fn(p, x, *s), None)
    if not self.indexed:
      out = lax.scan(lambda x, p: fn(p, x, *side), x, params)
    else:
      (mb_side, first), layers = side[0], jax.tree.leaves(params)[0].shape[0]
      body = lambda x, pl: fn(pl[0], x, (mb_side, first + pl[1]))
      out = lax.scan(body, x, (params, jnp.arange(layers)))
    return out if self.has_aux else out[0]

  def at_layer(self, side, l):
    """A layer's side inputs from its stage's.

    Args:
      side: the stage's side inputs; with `indexed`, `(side, index of the stage's first layer)`.
      l: the layer's place in the stage (traced or int).

    Returns:
      `side` itself; with `indexed`, `(side, the stage's first index plus l)`.
    """
    return (side[0], side[1] + l) if self.indexed else side

  def __eq__(self, other):
    return (
        isinstance(other, Layered)
        and other.layer_fn == self.layer_fn
        and other.has_aux == self.has_aux
        and other.indexed == self.indexed
    )

  def __hash__(self):
    return hash((Layered, self.layer_fn, self.has_aux, self.indexed))

  def __repr__(self):
    return f"layered({self.layer_fn!r})"


def layered(layer_fn: Callable) -> Layered:
  """Marks a stage as layers of `layer_fn`.

  Args:
    layer_fn: `(params_of_one_layer, x) -> x`.

  Returns:
    A `Layered` stage, whose params are leaves [layers_per_stage, ...].
  """
  return Layered(layer_fn)


@dataclasses.dataclass
class _Residuals:
  """How one function's `jax.vjp` closure splits into what F stores and what B/W rebuild.

  Each closure leaf is one of: a parameter leaf itself (matched by identity while tracing; the
  backward passes the live parameter), derived from the parameters alone (e.g. a weight cast to
  the compute dtype; the backward recomputes it from the live parameters), or stored per
  micro-batch in a residual slot. Leaves that depend on the side inputs (e.g. an attention mask
  built from segment ids) depend on the micro-batch, so they are stored.
  """

  fn: Callable  # (params, x, side) -> (y, aux)
  x: jax.ShapeDtypeStruct
  treedef: Any
  kinds: tuple[tuple, ...]  # per closure leaf: ("param", j) | ("derived",) | ("stored",)
  stored: tuple[jax.ShapeDtypeStruct, ...]  # the stored leaves, in order
  side: PyTree = ()  # shapes of one micro-batch's side inputs

  @classmethod
  def probe(
      cls,
      fn,
      params: PyTree,
      x: jax.ShapeDtypeStruct,
      has_aux: bool = False,
      side: PyTree | None = None,
  ) -> _Residuals:
    """`fn(params, x) -> y`, or `-> (y, aux)` with has_aux; given `side` (one micro-batch's
    side inputs, shapes), `fn(params, x, side)`, differentiated in params and x only."""
    fn = _uniform(fn, has_aux, side is not None)
    side = () if side is None else side
    found = {}

    def f(params, x, side):
      _, vjp_fn, _ = jax.vjp(lambda p, x: fn(p, x, side), params, x, has_aux=True)
      leaves, treedef = jax.tree.flatten(vjp_fn)
      found["treedef"] = treedef
      found["param_of_leaf"] = _match(leaves, jax.tree.leaves(params))
      return leaves

    closed = jax.make_jaxpr(f)(params, x, side)
    on_x = _depends_on_inputs(
        closed.jaxpr, range(len(jax.tree.leaves(params)), len(closed.jaxpr.invars))
    )
    kinds, stored = [], []
    for j, dep, out in zip(found["param_of_leaf"], on_x, closed.out_avals):
      if j is not None:
        kinds.append(("param", j))
      elif not dep:
        kinds.append(("derived",))
      else:
        kinds.append(("stored",))
        stored.append(jax.ShapeDtypeStruct(out.shape, out.dtype))
    return cls(fn, x, found["treedef"], tuple(kinds), tuple(stored), side)

  def split(self, vjp_fn, params: PyTree) -> list[jax.Array]:
    leaves = jax.tree.leaves(vjp_fn)
    got = _match(leaves, jax.tree.leaves(params))
    want = tuple(k[1] if k[0] == "param" else None for k in self.kinds)
    if any(w is not None and g != w for g, w in zip(got, want)) or len(got) != len(want):
      raise RuntimeError(
          "the stage's vjp closure changed structure between traces; "
          f"expected parameter leaves at {want}, got {got}"
      )
    return [l for l, k in zip(leaves, self.kinds) if k[0] == "stored"]

  def join(self, stored: Sequence[jax.Array], params: PyTree):
    live = jax.tree.leaves(params)
    derived = None
    if any(k[0] == "derived" for k in self.kinds):
      # Only the parameter-derived leaves of this trace are used; XLA drops the rest.
      zeros = jnp.zeros(self.x.shape, self.x.dtype)
      side = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.side)
      fn = lambda p, x: self.fn(p, x, side)
      derived = jax.tree.leaves(jax.vjp(fn, params, zeros, has_aux=True)[1])
    it = iter(stored)
    leaves = [
        live[k[1]] if k[0] == "param" else derived[i] if k[0] == "derived" else next(it)
        for i, k in enumerate(self.kinds)
    ]
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
  """Forward, input-cotangent (I), weight-cotangent (W) and full backward (B) of one stage, each
  reading and writing the rank's slot buffers in place.

  F keeps `stored` per micro-batch in the residual buffers `res` (vjp residuals without the
  parameters, one entry per layer for a layered stage, or just the input when recomputing); I
  leaves `g` for W in the `wg` buffer (the output cotangent, or one per layer). B and W add weight
  cotangents into `grads[chunk]` (layer by layer for a layered stage). `need_dx` (traced bool) is
  False where the input cotangent has no consumer. `stage_fn` is `(params, x, side) -> (y, aux)`
  (`with_aux`); only F keeps aux. Every part takes `side`, the side inputs of the micro-batch it
  runs (`()` without them); the backward parts read them only when they recompute.
  """

  def __init__(
      self,
      stage_fn,
      params: PyTree,
      x: jax.ShapeDtypeStruct,
      recompute: bool,
      model: Model | None = None,
      side: PyTree = (),
  ):
    self.fn, self.recompute = stage_fn, recompute
    # per parameter leaf: weight cotangents combined by max (Model.max_grads) rather than added
    self.by_max = jax.tree_util.tree_map_with_path(lambda p, _: combines_by_max(model, p), params)
    self.layered = isinstance(stage_fn, Layered)
    self.x = x
    self.aux = jax.eval_shape(stage_fn, params, x, side)[1]
    if self.layered:
      self.num_layers = jax.tree.leaves(params)[0].shape[0]
      one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
      self.resid = _Residuals.probe(stage_fn.layer_fn, one, x, has_aux=True, side=side)
      stack = lambda s: jax.ShapeDtypeStruct((self.num_layers,) + s.shape, s.dtype)
      kept = tuple(stack(s) for s in self.resid.stored)
      # a split backward: I hands W what W's own equations read, so neither redoes the other's
      self.split = None
      if not recompute:
        backward = lambda stored, p, g: self.resid.join(stored, p)(g)
        self.split = split_backward(backward, list(self.resid.stored), one, x)
      self.g = tuple(stack(s) for s in (self.split.kept if self.split else (x,)))
    else:
      self.resid = (
          None if recompute else _Residuals.probe(stage_fn, params, x, has_aux=True, side=side)
      )
      kept = None if recompute else self.resid.stored
      self.split = None
      self.g = (x,)
    self.stored = (x,) if recompute else kept

  def zero_x(self):
    return jnp.zeros(self.x.shape, self.x.dtype)

  # -- forward ---------------------------------------------------------------------------------

  def _layer_residuals(self, params, x, side):
    """-> (y, (stored, aux stacked per layer))"""

    def body(x, layer):
      p, l = layer
      layer_fn = lambda p, x: self.fn.layer_fn(p, x, self.fn.at_layer(side, l))
      y, vjp_fn, aux = jax.vjp(layer_fn, p, x, has_aux=True)
      return y, (self.resid.split(vjp_fn, p), aux)

    return lax.scan(body, x, (params, jnp.arange(self.num_layers)))

  def forward(self, params, x, side, res, slot):
    """-> (y, res holding this micro-batch's stored values at `slot`, aux)"""
    if self.recompute:
      y, aux = self.fn(params, x, side)
      return y, [_set(res[0], (slot,), x)], aux
    if self.layered:

      def body(carry, layer):
        (x, res), (p, l) = carry, layer
        layer_fn = lambda p, x: self.fn.layer_fn(p, x, self.fn.at_layer(side, l))
        y, vjp_fn, aux = jax.vjp(layer_fn, p, x, has_aux=True)
        # each layer's residuals go straight into their slot: no stacked copy to move later
        res = [_set(b, (slot, l), v) for b, v in zip(res, self.resid.split(vjp_fn, p))]
        return (y, res), aux

      (y, res), aux = lax.scan(body, (x, res), (params, jnp.arange(self.num_layers)))
      return y, res, aux
    y, vjp_fn, aux = jax.vjp(lambda p, x: self.fn(p, x, side), params, x, has_aux=True)
    return y, [_set(b, (slot,), v) for b, v in zip(res, self.resid.split(vjp_fn, params))], aux

  def _layer_vjp(self, params, side, res, slot) -> Callable:
    """layer -> that layer's vjp function, from what F stored at `slot` (layered stages)."""
    if self.recompute:
      stacked = self._layer_residuals(params, res[0][slot], side)[1][0]
      read = lambda l: [r[l] for r in stacked]
    else:
      read = lambda l: _at(res, slot, l)
    return lambda l: self.resid.join(read(l), _index(params, l))

  def _vjp(self, params, side, res, slot):
    """The stage's vjp function, from what F stored at `slot` (opaque stages)."""
    if self.recompute:
      return jax.vjp(lambda p, x: self.fn(p, x, side), params, res[0][slot], has_aux=True)[1]
    return self.resid.join(_at(res, slot), params)

  # -- backward --------------------------------------------------------------------------------
  # Layers run in reverse, layers L-1..1 in a scan and layer 0 last, so that its input cotangent
  # can be skipped where nothing needs it.

  def _dx(self, vjp_fn, g, need_dx):
    return lax.cond(need_dx, lambda: vjp_fn(g)[1], self.zero_x)

  def input_grad(self, params, side, res, slot, dy, need_dx, wg, wg_slot):
    """I: -> (dx, wg holding what W needs at `wg_slot`)"""
    if not self.layered:
      dx = self._dx(self._vjp(params, side, res, slot), dy, need_dx)
      return dx, [_set(wg[0], (wg_slot,), dy)]
    if self.split is not None:
      half = lambda l, g, need_dx=True: self.split.input_half(
          _at(res, slot, l), _index(params, l), g, need_dx
      )
      keep = lambda wg, l, kept: [_set(b, (wg_slot, l), k) for b, k in zip(wg, kept)]

      def body(carry, l):
        g, wg = carry
        dx, kept = half(l, g)
        return (dx, keep(wg, l, kept)), None

      (g0, wg), _ = lax.scan(body, (dy, wg), jnp.arange(self.num_layers - 1, 0, -1))
      dx, kept = half(0, g0, need_dx)
      return dx, keep(wg, 0, kept)
    vjp_of = self._layer_vjp(params, side, res, slot)

    def body(carry, l):
      g, (wg,) = carry
      return (vjp_of(l)(g)[1], [_set(wg, (wg_slot, l), g)]), None

    (g0, wg), _ = lax.scan(body, (dy, wg), jnp.arange(self.num_layers - 1, 0, -1))
    return self._dx(vjp_of(0), g0, need_dx), [_set(wg[0], (wg_slot, 0), g0)]

  def full_grad(self, params, side, res, slot, dy, need_dx, grads, chunk):
    """B: -> (dx, grads plus this micro-batch's weight cotangents at `chunk`)"""
    if not self.layered:
      vjp_fn = self._vjp(params, side, res, slot)
      return self._dx(vjp_fn, dy, need_dx), _add(grads, (chunk,), vjp_fn(dy)[0], self.by_max)
    if self.split is not None:
      # I's equations then W's, each once: the two halves of one backward
      def full(l, g, grads, need_dx=True):
        stored, layer = _at(res, slot, l), _index(params, l)
        dx, kept = self.split.input_half(stored, layer, g, need_dx)
        return dx, _add(grads, (chunk, l), self.split.weight_half(stored, layer, kept), self.by_max)

      (g0, grads), _ = lax.scan(
          lambda carry, l: (full(l, *carry), None),
          (dy, grads),
          jnp.arange(self.num_layers - 1, 0, -1),
      )
      return full(0, g0, grads, need_dx)
    vjp_of = self._layer_vjp(params, side, res, slot)

    def body(carry, l):
      g, grads = carry
      dp, dx = vjp_of(l)(g)
      return (dx, _add(grads, (chunk, l), dp, self.by_max)), None

    (g0, grads), _ = lax.scan(body, (dy, grads), jnp.arange(self.num_layers - 1, 0, -1))
    vjp0 = vjp_of(0)
    return self._dx(vjp0, g0, need_dx), _add(grads, (chunk, 0), vjp0(g0)[0], self.by_max)

  def weight_grad(self, params, side, res, slot, wg, wg_slot, grads, chunk):
    """W: -> grads plus the weight cotangents of what I left at `wg_slot`, at `chunk`"""
    if not self.layered:
      vjp_fn = self._vjp(params, side, res, slot)
      return _add(grads, (chunk,), vjp_fn(wg[0][wg_slot])[0], self.by_max)
    if self.split is not None:
      dp_of = lambda l: self.split.weight_half(
          _at(res, slot, l), _index(params, l), _at(wg, wg_slot, l)
      )
    else:
      vjp_of = self._layer_vjp(params, side, res, slot)
      dp_of = lambda l: vjp_of(l)(wg[0][wg_slot, l])[0]

    def body(grads, l):
      return _add(grads, (chunk, l), dp_of(l), self.by_max), None

    return lax.scan(body, grads, jnp.arange(self.num_layers))[0]


def _at(bufs: Sequence[jax.Array], *index) -> list[jax.Array]:
  """Each buffer's entry at `index` (a slot, or a slot and a layer)."""
  return [b[index] for b in bufs]


def _set(buf, index: tuple, value):
  """buf[index] = value for an index in range: an in-place dynamic-update-slice."""
  start = tuple(index) + (0,) * value.ndim
  value = value.astype(buf.dtype).reshape((1,) * len(index) + value.shape)
  return lax.dynamic_update_slice(buf, value, tuple(jnp.asarray(i, jnp.int32) for i in start))


def _add(acc: PyTree, index: tuple, value: PyTree, by_max: PyTree | None = None) -> PyTree:
  """acc[index] += value, leaf by leaf, in place (accumulators may be wider than the values);
  max(acc[index], value) instead where the `by_max` tree of bools says so."""

  def one(a, v, maxed=False):
    start = tuple(jnp.asarray(i, jnp.int32) for i in tuple(index) + (0,) * v.ndim)
    old = lax.dynamic_slice(a, start, (1,) * len(index) + v.shape)
    v = v.astype(a.dtype).reshape(old.shape)
    return lax.dynamic_update_slice(a, jnp.maximum(old, v) if maxed else old + v, start)

  if by_max is None:
    return jax.tree.map(one, acc, value)
  return jax.tree.map(one, acc, value, by_max)


def _gated(row, col: int, fn: Callable, state: dict, keys: Sequence[str], unset: int = 0) -> dict:
  """`state` with its entries `keys` replaced by `fn(row, those entries)` where row[col] !=
  unset, updated in place.

  A `lax.cond` returns fresh buffers, so every slot buffer it passed through untouched would be
  copied on every tick; a while loop of 0 or 1 trips updates its carry in place. `fn` reads the
  row from the loop's carry, which the loop changes, so that XLA cannot hoist the part's work
  out of the loop as invariant and run it on every tick. The state leaves through an
  optimization barrier: a buffer the loop only reads would otherwise pass straight through, be
  read by several loops at once, and be copied for each.
  """

  def body(carry):
    row, part = carry
    return row.at[col].set(unset), lax.optimization_barrier(fn(row, part))

  part = {k: state[k] for k in keys}
  return {**state, **lax.while_loop(lambda c: c[0][col] != unset, body, (row, part))[1]}


def io_spec(batch_axes: tuple[str, ...], seq_axes: tuple[str, ...]) -> P:
  """The spec of xs/targets leaves [microbatches, batch, seq, ...]: batch and sequence split.

  Args:
    batch_axes: the mesh axes that split the batch (axis 1).
    seq_axes: the mesh axes that split the sequence (axis 2).

  Returns:
    The PartitionSpec; micro-batches are not split.
  """
  return P(None, batch_axes or None, *((seq_axes,) if seq_axes else ()))


def check_param_specs(
    param_specs: tuple,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    pp_axis: str,
    params: PyTree | None = None,
    model_axes: tuple[str, ...] = (),
) -> None:
  """Checks that a `param_specs_key` splits leaves over data, sequence and model axes only.

  A leaf split over data or sequence axes is one the stage gathers (FSDP): its gradient is not
  summed over them.

  Args:
    param_specs: a `param_specs_key`, `(treedef, leaf specs)`.
    data_axes: the data axes.
    seq_axes: the sequence axes.
    pp_axis: the pipeline axis (named in the error).
    params: one stage's params, or None; given them, the key must have their structure.
    model_axes: the model (tensor-parallel) axes.

  Raises:
    ValueError: the key's structure differs from `params`', or an entry splits a leaf over an
      axis that is none of the data, sequence or model axes.
  """
  treedef, leaf_specs = param_specs
  if params is not None and jax.tree.structure(params) != treedef:
    raise ValueError(
        f"param_specs has structure {treedef} but the stage params have "
        f"{jax.tree.structure(params)}; give one spec per parameter leaf"
    )
  for leaf_spec in leaf_specs:
    bad = [a for a in _leaf_axes(leaf_spec) if a not in data_axes + seq_axes + model_axes]
    if bad:
      raise ValueError(
          f"param_specs entry {leaf_spec} shards over {bad}, which are not "
          f"data axes {data_axes}, sequence axes {seq_axes} or model axes {model_axes} of this "
          f"executor; parameters split over {pp_axis!r} go on the leading [ranks, chunks] "
          "axes instead"
      )


def scatter_of(
    grad_specs: tuple, param_specs: tuple | None, data_axes: tuple[str, ...]
) -> tuple[tuple[int, tuple[str, ...]] | None, ...]:
  """Where each leaf's gradient is reduce-scattered, from a `grad_specs` key.

  Args:
    grad_specs: a `param_specs_key` of the gradient specs.
    param_specs: the `param_specs_key` of the parameter specs, or None (every entry None).
    data_axes: the data axes a gradient may be reduce-scattered over.

  Returns:
    Per leaf: `(dimension, data axes)` its gradient is reduce-scattered over, or None.

  Raises:
    ValueError: the two keys' structures differ, or an entry (named in the message) does not
      repeat its `param_specs` one but for data axes added on one dimension that one leaves
      whole.
  """
  treedef, leaves = grad_specs
  params = (treedef, (P(),) * len(leaves)) if param_specs is None else param_specs
  if params[0] != treedef:
    raise ValueError(
        f"grad_specs has structure {treedef} but param_specs has {params[0]}; give one "
        "spec per parameter leaf"
    )
  out = []
  for grad, param in zip(leaves, params[1]):
    width = max(len(grad), len(param))
    g = tuple(grad) + (None,) * (width - len(grad))
    q = tuple(param) + (None,) * (width - len(param))
    added = [(d, _leaf_axes(P(e))) for d, (e, f) in enumerate(zip(g, q)) if e != f]
    ok = len(added) <= 1 and all(
        q[d] is None and all(a in data_axes for a in axes) for d, axes in added
    )
    if not ok:
      raise ValueError(
          f"grad_specs entry {grad} against param_specs entry {param}: a gradient may only "
          f"add data axes {data_axes} on one dimension the parameter leaves whole"
      )
    out.append(added[0] if added else None)
  return tuple(out)


def _leaf_axes(spec: P) -> tuple[str, ...]:
  names = []
  for entry in spec:
    names += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
  return tuple(names)


def reduce_grads(
    tree: PyTree,
    specs: tuple | None,
    axes: tuple[str, ...],
    model_axes: tuple[str, ...],
    model: Model | None,
    scatter: tuple | None = None,
) -> PyTree:
  """Gradients accumulated on one device, reduced over the mesh axes each leaf is copied on.

  A sharded leaf's slices are different parameters, not copies: each leaf is summed (its max
  taken, for the leaves `model` combines by max) over `axes` and `model_axes` except those its
  spec splits it over. Runs inside a `shard_map` over those axes.

  Args:
    tree: the gradients, as accumulated on this device.
    specs: a `param_specs_key` of `tree` (None: every leaf replicated).
    axes: the axes to reduce over besides the model axes: data and sequence axes, and the
      pipeline axis for parameters every rank holds.
    model_axes: the tensor-parallel axes, reduced over as `axes` are.
    model: the model whose `Model.max_grads` picks the leaves combined by max, or None.
    scatter: per leaf of chunk-stacked leaves [chunks, ...] (`scatter_of`): (dimension of the
      chunk's leaf, data axes) to reduce-scatter it over instead of summing it, or None.

  Returns:
    `tree` reduced, each leaf of its input's shape but for a reduce-scattered dimension.

  Raises:
    ValueError: `scatter` splits a leaf whose gradient combines by max.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  reduced = []
  for i, (path, g) in enumerate(flat):
    own = () if specs is None else _leaf_axes(specs[1][i])
    over = tuple(a for a in axes + model_axes if a not in own)
    by_max = combines_by_max(model, path)
    split = None if scatter is None else scatter[i]
    if split is not None and by_max:
      raise ValueError(
          f"grad_specs splits {jax.tree_util.keystr(path)}, whose gradient combines by "
          "max (Model.max_grads): a reduce-scatter would add its slices; leave it whole"
      )
    if split is not None:
      dim, scattered = split
      over = tuple(a for a in over if a not in scattered)
    g = (lax.pmax if by_max else lax.psum)(g, over) if over else g
    if split is not None:  # leaves [chunks, ...]: the chunk's dimension `dim` is 1 + dim
      g = lax.psum_scatter(g, scattered, scatter_dimension=1 + dim, tiled=True)
    reduced.append(g)
  return jax.tree.unflatten(treedef, reduced)


@dataclasses.dataclass(frozen=True, eq=False)
class _TickPlan:
  """What a tick may run under one `ExecSpec`, fixed when the executor is built.

  A row of the table gets, after its `COL` columns, one flag per part (PARTS order), looked up
  from its branch code, then one per ppermute of `sends`: whether any rank receives over it in
  that tick.
  """

  present: frozenset[str]  # the parts some compiled branch runs
  part_flags: np.ndarray  # int32 [branch code, part]: whether the branch runs the part
  run_col: dict[str, int]  # the row column of each part's flag
  link_col: int  # the row column of the first ppermute's flag
  shared_link: bool  # F's output and I's or B's input cotangent leave through one buffer
  out_f: str  # the state buffer F's output leaves through
  out_b: str  # the state buffer I's or B's input cotangent leaves through
  # the ppermutes of a tick: (direction, kinds of value it carries, buffer it sends)
  sends: tuple[tuple[str, tuple[str, ...], str], ...]
  perms: dict[str, list[tuple[int, int]]]  # per direction: the (source, target) rank pairs

  @classmethod
  def of(cls, spec: ExecSpec) -> _TickPlan:
    """The plan of the program compiled for `spec`."""
    p = spec.num_ranks
    parts_of = [set(BRANCHES[c].split("+")) - {"idle"} for c in range(len(BRANCHES))]
    # Without a branch that runs F beside I or B, a rank sends at most one of y and dx per
    # tick, so both can leave through one buffer, and the activation and cotangent channels of
    # one direction can share a ppermute.
    shared_link = not any("F" in parts_of[c] and parts_of[c] & {"I", "B"} for c in spec.branches)
    out_f, out_b = ("out", "out") if shared_link else ("out_y", "out_dx")
    sends = []
    for direction in ("down", "up"):
      on = tuple(
          kind for kind in ("act", "grad") if spec.channels[CHANNELS.index(f"{kind}_{direction}")]
      )
      if shared_link and len(on) == 2:
        sends.append((direction, on, "out"))
      else:
        sends += [(direction, (kind,), out_f if kind == "act" else out_b) for kind in on]
    return cls(
        present=frozenset().union(*(parts_of[c] for c in spec.branches)),
        part_flags=np.array([[kind in parts for kind in PARTS] for parts in parts_of], np.int32),
        run_col={kind: len(COL) + i for i, kind in enumerate(PARTS)},
        link_col=len(COL) + len(PARTS),
        shared_link=shared_link,
        out_f=out_f,
        out_b=out_b,
        sends=tuple(sends),
        perms={
            "down": [(i, (i + 1) % p) for i in range(p)],
            "up": [(i, (i - 1) % p) for i in range(p)],
        },
    )

  def links(self, table: jax.Array) -> jax.Array:
    """int32 [ticks, sends] of a whole table [ticks, ranks, ...]: whether any rank receives over
    each ppermute, the same on every rank."""
    return jnp.stack(
        [
            jnp.any(
                jnp.stack([table[:, :, COL[f"recv_{kind}_{direction}"]] for kind in kinds]) >= 0,
                axis=(0, 2),
            )
            for direction, kinds, _ in self.sends
        ]
        or [jnp.zeros(table.shape[0], bool)],
        axis=1,
    )[:, : len(self.sends)].astype(jnp.int32)

  def rows(self, table: jax.Array, links: jax.Array) -> jax.Array:
    """One rank's table [ticks, len(COL)] with its part flags and the ticks' `links` after it."""
    return jnp.concatenate(
        [table, jnp.asarray(self.part_flags)[table[:, COL["branch"]]], links], axis=1
    )


class _RankProgram:
  """One rank's traced program inside the executor's `shard_map`: the parts of its ticks.

  Each part is `part(row, state) -> state` over the tick state (`init_state`): it reads its
  inputs from the rank's slot buffers and writes its outputs into them in place, so that a tick
  costs what its parts compute and move. `tick` runs the parts a row names, then the ppermutes.
  """

  def __init__(
      self,
      model: Model,
      stage_fn: Callable,
      spec: ExecSpec,
      plan: _TickPlan,
      sharding: PipelineSharding,
      local: PyTree,
      xs,
      targets,
      head_params: PyTree,
      embed_params: PyTree,
      side: PyTree,
      stages: jax.Array,
  ):
    """Traces one stage's shapes for the slot buffers.

    Args:
      model: the model the executor runs.
      stage_fn: its stage function as `(params, x, side) -> (y, aux)` (`with_aux`).
      spec: the executor's static sizes.
      plan: its tick plan.
      sharding: where the program's values sit on the mesh.
      local: this rank's stage params, leaves [chunks, ...].
      xs: the inputs, leaves [microbatches, batch, ...] (this device's slice).
      targets: the targets, likewise.
      head_params: the loss function's parameters.
      embed_params: the embed function's parameters.
      side: the side inputs, leaves [microbatches, batch, ...] (`Model.side_inputs`).
      stages: int32 [1, chunks], the model stage of each of this rank's chunks.

    Raises:
      ValueError: the stage function changes its input's shape or dtype.
    """
    self.model, self.spec, self.plan, self.sharding = model, spec, plan, sharding
    self.local, self.xs, self.targets = local, xs, targets
    self.head_params, self.embed_params = head_params, embed_params
    self.side, self.stages = side, stages
    self.embed_fn = model.embed_fn
    model_size = sharding.model_size
    # the loss each rank differentiates: its share of the one loss the model ranks compute
    self.seeded_loss = (
        model.loss_fn if model_size == 1 else lambda *a: model.loss_fn(*a) / model_size
    )
    # the layers of a chunk, by which Model.unit_index numbers a chunk's first layer
    self.layers = jax.tree.leaves(local)[0].shape[1] if model.unit_index else 0
    chunk0 = _index(local, 0)
    x_sd = jax.eval_shape(self.first_in, 0)
    self.x_sd = jax.ShapeDtypeStruct(x_sd.shape, x_sd.dtype)
    side_sd = jax.eval_shape(self.side_of, 0)
    y_sd = jax.eval_shape(stage_fn, chunk0, self.x_sd, side_sd)[0]
    if (y_sd.shape, y_sd.dtype) != (self.x_sd.shape, self.x_sd.dtype):
      raise ValueError(
          f"stage_fn must keep its input's shape and dtype: {self.x_sd.shape} "
          f"{self.x_sd.dtype} -> {y_sd.shape} {y_sd.dtype}"
      )
    self.ops = _StageOps(stage_fn, chunk0, self.x_sd, spec.recompute, model, side_sd)

  def side_of(self, mb, c=0) -> PyTree:
    """Micro-batch mb's side inputs; with `Model.unit_index` also chunk c's first layer in the
    model."""
    if self.model.unit_index:
      return (_index(self.side, mb), self.stages[0, c] * self.layers)
    return _index(self.side, mb)

  def first_in(self, mb) -> jax.Array:
    """The first stage's input for micro-batch mb: its embedding, or xs[mb] without embed_fn."""
    if self.embed_fn:
      return self.embed_fn(self.embed_params, _index(self.xs, mb))
    return _index(self.xs, mb)

  # -- parts -----------------------------------------------------------------------------------

  def forward(self, row, s: dict) -> dict:
    """F: row's f_mb through chunk f_chunk, and on the last stage (f_last) its loss."""
    mb, c = row[COL["f_mb"]], row[COL["f_chunk"]]
    x = lax.cond(
        row[COL["f_first"]] == 1, lambda: self.first_in(mb), lambda: s["act"][row[COL["f_in"]]]
    )
    y, res, aux = self.ops.forward(
        _index(self.local, c), x, self.side_of(mb, c), s["res"], row[COL["f_res"]]
    )
    s = dict(s, res=res, stats=_add(s["stats"], (c,), aux))
    s[self.plan.out_f] = y
    loss = functools.partial(self._loss, y)
    return _gated(row, COL["f_last"], loss, s, ("loss", "head_g", "cot"))

  def _loss(self, y, row, s: dict) -> dict:
    """The loss of the last stage's output y, its head gradient and y's cotangent."""
    target = jax.tree.map(lambda t: t[row[COL["f_mb"]]], self.targets)
    loss, (dhead, dy) = jax.value_and_grad(self.seeded_loss, argnums=(0, 1))(
        self.head_params, y, target
    )
    return dict(
        s,
        loss=s["loss"] + (loss * self.sharding.model_size).astype(jnp.float32),
        head_g=jax.tree.map(lambda a, d: a + d.astype(a.dtype), s["head_g"], dhead),
        cot=_set(s["cot"], (row[COL["f_cot"]],), dy),
    )

  def backward(self, row, s: dict, full: bool) -> dict:
    """B (`full`) or I: row's b_mb back through chunk b_chunk; on the first stage (b_first) the
    input cotangent goes on into the embedding."""
    c = row[COL["b_chunk"]]
    params, slot = _index(self.local, c), row[COL["b_res"]]
    side_mb = self.side_of(row[COL["b_mb"]], c)
    res, dy = s.get("res"), None
    if res is None:  # its own copies of the slots (`backward_reads`)
      res, slot, dy = s["b_res"], 0, s["b_dy"][0]
    else:
      dy = s["cot"][row[COL["b_cot"]]]
    # The first stage's input cotangent feeds only the embedding, if there is one.
    need_dx = row[COL["b_first"]] == 0 if self.embed_fn is None else jnp.bool_(True)
    if full:
      dx, grads = self.ops.full_grad(params, side_mb, res, slot, dy, need_dx, s["grads"], c)
      s = dict(s, grads=grads)
    else:
      dx, wg = self.ops.input_grad(
          params, side_mb, res, slot, dy, need_dx, s["wg"], row[COL["b_wg"]]
      )
      s = dict(s, wg=wg)
    s[self.plan.out_b] = dx
    if self.embed_fn is None:
      return s
    embed_grad = functools.partial(self._embed_grad, dx)
    return _gated(row, COL["b_first"], embed_grad, s, ("embed_g",))

  def backward_reads(self, row, s: dict) -> dict:
    """I's or B's residual slot and input cotangent copied into buffers of their own (`b_res`,
    `b_dy`), so that the backward's chain reads nothing F writes in the tick."""
    slot, cot = row[COL["b_res"]], row[COL["b_cot"]]
    one = lambda buf, i: lax.dynamic_slice_in_dim(buf, i, 1)
    return dict(s, b_res=[one(r, slot) for r in s["res"]], b_dy=one(s["cot"], cot))

  def _embed_grad(self, dx, row, s: dict) -> dict:
    """The embedding's gradient from the first stage's input cotangent dx."""
    _, embed_vjp = jax.vjp(
        lambda e: self.embed_fn(e, _index(self.xs, row[COL["b_mb"]])), self.embed_params
    )
    return dict(
        s,
        embed_g=jax.tree.map(lambda a, d: a + d.astype(a.dtype), s["embed_g"], embed_vjp(dx)[0]),
    )

  def weight(self, row, s: dict) -> dict:
    """W: the weight cotangents of row's w_mb on chunk w_chunk, from what its I kept."""
    c = row[COL["w_chunk"]]
    return dict(
        s,
        grads=self.ops.weight_grad(
            _index(self.local, c),
            self.side_of(row[COL["w_mb"]], c),
            s["res"],
            row[COL["w_res"]],
            s["wg"],
            row[COL["w_wg"]],
            s["grads"],
            c,
        ),
    )

  def keep_local(self, row, s: dict, field: str, buf: str, slot_buf: str) -> dict:
    """A value for the same rank (V shapes) goes from its send buffer to its slot after the part
    that made it: a part writing a slot buffer it also reads would make XLA copy the buffer."""
    move = lambda row, s: dict(s, **{slot_buf: _set(s[slot_buf], (row[COL[field]],), s[buf])})
    return _gated(row, COL[field], move, s, (buf, slot_buf), unset=-1)

  def send(self, direction: str, kinds: tuple[str, ...], buf: str, row, s: dict) -> dict:
    """One ppermute of `buf` over the pipeline axis; where the row receives, into its slot."""
    got = lax.ppermute(s[buf], self.sharding.pp_axis, self.plan.perms[direction])
    for kind in kinds:
      col, name = COL[f"recv_{kind}_{direction}"], "act" if kind == "act" else "cot"
      s = _gated(
          row, col, lambda row, s: {name: _set(s[name], (row[col],), got)}, s, (name,), unset=-1
      )
    return s

  def tick(self, s: dict, row) -> tuple[dict, None]:
    """One tick, a `lax.scan` step: the parts the row names, then the ppermutes."""
    plan, out_f, out_b = self.plan, self.plan.out_f, self.plan.out_b
    # A part reads only values written in earlier ticks, and a slot freed by its last read may
    # be written again in the same tick: so readers run first (W reads res and wg; I or B reads
    # res and cot and writes wg; F reads act and writes res and cot), receipts last.
    # Where a branch runs F beside I or B (`overlap`: DualPipe's F&B), the backward first copies
    # its slots out (`backward_reads`) and the two chains share no buffer: F waits for that copy
    # only, and neither chain's collectives wait for the other's compute.
    overlap = not plan.shared_link
    reads = ("b_res", "b_dy") if overlap else ("res", "cot")
    parts = {
        "W": (self.weight, ("res", "wg", "grads")),
        "I": (functools.partial(self.backward, full=False), reads + ("wg", out_b, "embed_g")),
        "B": (functools.partial(self.backward, full=True), reads + ("grads", out_b, "embed_g")),
        "F": (self.forward, ("act", "res", "cot", out_f, "loss", "head_g", "stats")),
    }
    for kind in ("W", "I", "B", "F"):
      if kind not in plan.present:
        continue
      fn, keys = parts[kind]
      if overlap and kind in ("I", "B"):
        with jax.named_scope(f"tick/{kind}_reads"):
          s = _gated(
              row, plan.run_col[kind], self.backward_reads, s, ("res", "cot", "b_res", "b_dy")
          )
      with jax.named_scope(f"tick/{kind}"):
        s = _gated(row, plan.run_col[kind], fn, s, keys)
    # after both chains: B's kept cotangent goes into `cot`, which F writes too
    if plan.present & {"I", "B"} and self.spec.local_moves[1]:
      s = self.keep_local(row, s, "b_local", out_b, "cot")
    if "F" in plan.present and self.spec.local_moves[0]:
      s = self.keep_local(row, s, "f_local", out_f, "act")
    # A ppermute runs where some rank receives over it this tick (its flag is the same on every
    # rank, so every rank takes part or none does); a rank with nothing to send sends whatever
    # its buffer holds and its neighbour's table discards it.
    for i, (direction, kinds, buf) in enumerate(plan.sends):
      with jax.named_scope(f"tick/send_{direction}"):
        s = _gated(
            row,
            plan.link_col + i,
            functools.partial(self.send, direction, kinds, buf),
            s,
            (buf,) + tuple("act" if kind == "act" else "cot" for kind in kinds),
        )
    return s, None

  # -- state -----------------------------------------------------------------------------------

  def init_state(self) -> dict:
    """The tick state before the first tick: empty slot buffers, zero accumulators."""
    spec, ops, x_sd = self.spec, self.ops, self.x_sd
    # at least one slot, so that parts reading a buffer trace even when none is used
    slots = lambda n, sd: jnp.zeros((max(n, 1),) + sd.shape, sd.dtype)
    acc = lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype))
    state = dict(
        act=slots(spec.act_slots, x_sd),
        res=[slots(spec.res_slots, s) for s in ops.stored],
        cot=slots(spec.cot_slots, x_sd),
        # what I keeps for W; no buffer where no part splits a backward
        wg=[slots(spec.wg_slots, g) for g in ops.g] if self.plan.present & {"I", "W"} else [],
        grads=jax.tree.map(acc, self.local),
        loss=jnp.zeros((), jnp.float32),
        head_g=jax.tree.map(acc, self.head_params),
        embed_g=jax.tree.map(acc, self.embed_params),
        stats=jax.tree.map(
            lambda a: jnp.zeros((spec.chunks,) + a.shape, _aux_dtype(a.dtype)), ops.aux
        ),
    )
    for name in {self.plan.out_f, self.plan.out_b}:
      state[name] = ops.zero_x()
    if not self.plan.shared_link:  # the backward's own copies of its slots (`backward_reads`)
      state.update(b_res=[slots(1, s) for s in ops.stored], b_dy=slots(1, x_sd))
    return state

  def results(self, state: dict, scatter: tuple | None) -> tuple:
    """What the `shard_map` returns from the state after the last tick: the loss and gradients
    reduced over the axes their values are copied on (`reduce_grads`, with `scatter` for the
    stage gradients), cast to their parameters' dtypes, then with `Model.stage_aux` the stats."""
    sharding, model = self.sharding, self.model
    grads, head_g, embed_g, stats = (state[k] for k in ("grads", "head_g", "embed_g", "stats"))
    all_axes = (sharding.pp_axis,) + sharding.token_axes
    loss = lax.psum(state["loss"], all_axes)
    model_axes = sharding.model_axes
    grads = reduce_grads(grads, sharding.param_key, sharding.token_axes, model_axes, model, scatter)
    head_g = reduce_grads(head_g, sharding.head_key, all_axes, model_axes, model)
    embed_g = reduce_grads(embed_g, sharding.embed_key, all_axes, model_axes, model)
    cast = lambda g, a: g.astype(a.dtype)
    out = (
        loss,
        jax.tree.map(lambda g, a: cast(g, a)[None], grads, self.local),
        jax.tree.map(cast, head_g, self.head_params),
        jax.tree.map(cast, embed_g, self.embed_params),
    )
    if model.stage_aux:
      out += (jax.tree.map(lambda a: a[None, :, None], stats),)
    return out


def _stage_fn_of(model: Model) -> Callable:
  """The model's stage function as the executor calls it (`with_aux`)."""
  if model.unit_index and not isinstance(model.stage_fn, Layered):
    raise ValueError("Model.unit_index numbers the layers of a layered stage; wrap it in layered()")
  return with_aux(model.stage_fn, model.stage_aux, model.side_inputs, model.unit_index)


def _check_sharding(spec: ExecSpec, sharding: PipelineSharding) -> None:
  """Raises ValueError unless `sharding`'s mesh and axes fit `spec` and its specs split leaves
  over data, sequence and model axes only."""
  mesh, pp_axis = sharding.mesh, sharding.pp_axis
  if pp_axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack the pipeline axis {pp_axis!r}")
  if mesh.shape[pp_axis] != spec.num_ranks:
    raise ValueError(
        f"the schedule has {spec.num_ranks} ranks but mesh axis {pp_axis!r} has "
        f"{mesh.shape[pp_axis]} devices; make them equal"
    )
  batch_axes, seq_axes, model_axes = sharding.batch_axes, sharding.seq_axes, sharding.model_axes
  both = sorted(set(batch_axes) & set(seq_axes))
  if both or pp_axis in batch_axes + seq_axes:
    raise ValueError(
        f"data_axes {batch_axes} and seq_axes {seq_axes} must be disjoint and leave "
        f"out the pipeline axis {pp_axis!r}; drop {both or [pp_axis]} from one"
    )
  all_axes = (pp_axis,) + sharding.token_axes
  clash = sorted(set(model_axes) & set(all_axes))
  if clash:
    raise ValueError(
        f"model_axes {model_axes} must leave out the pipeline, data and sequence axes "
        f"{all_axes}; drop {clash}"
    )
  for key in (sharding.param_key, sharding.head_key, sharding.embed_key):
    if key is not None:
      check_param_specs(key, batch_axes, seq_axes, pp_axis, model_axes=model_axes)


def make_executor(model: Model, spec: ExecSpec, sharding: PipelineSharding | Mesh) -> Callable:
  """The executor's program for `model` under tables that fit `spec`, split as `sharding` says.

  The program is a jitted `run(table, local_params, xs, targets, head_params, embed_params,
  side=(), stages=None)`:

  - table: int32 [spec.num_ticks, p, len(FIELDS)] (`Lowered.padded`).
  - local_params: leaves [p, chunks, ...], rank r's chunk c at [r, c], each chunk's own
    dimensions split as `sharding.param_specs` says.
  - xs, targets: leaves [microbatches, batch, seq, ...], the batch axis split over the data axes
    and the sequence axis over the sequence axes (context parallelism: the stage, embedding and
    loss functions then see a slice of every sequence and run their own collectives over those
    axes; a data shard, in what follows, is one slice over data and sequence axes).
  - head_params, embed_params: the loss and embed functions' parameters.
  - side: with `model.side_inputs`, the side inputs, leaves [microbatches, batch, ...] split as
    xs is (docs/schedules.md, "The executor").
  - stages: int32 [p, chunks], the model stage each rank's chunk computes
    (`Lowered.layout()`), which `Model.unit_index` needs to number the layers.

  It returns (loss summed over micro-batches and data shards, local gradients like
  local_params, head_params gradients, embed_params gradients), each reduced over the data axes
  its parameter is not sharded over, and with `model.stage_aux` the stage aux summed over
  micro-batches: leaves [p, chunks, data shards, ...] (rank r's chunk c as seen by data shard
  d, ordered over the data axes then the sequence axes).

  Model axes (tensor parallelism) are axes whose ranks see the same tokens and together compute
  one loss, each with its slice of some parameters (`param_specs`, `head_specs` and
  `embed_specs` may split leaves over them) and running their own collectives over them. The
  loss is counted once. Without varying-axes checks the backward of a model-axis collective (a
  psum's is a psum) treats every rank's copy of the loss as its own: so each rank seeds its
  loss's backward with 1 / (model ranks), and gradients are then summed over the model axes a
  leaf is not split over, as over data axes. A split value's cotangent is then the single
  loss's whole; a replicated value's arrives as per-rank partials (their sum is the single
  loss's).

  `grad_specs` (ZeRO-2) says where the returned local gradients are split. A leaf's entry
  repeats its `param_specs` one but may add data axes on a dimension that one leaves whole: the
  leaf's gradient then leaves reduce-scattered over those axes along that dimension
  (`psum_scatter`) instead of summed over them, each data shard keeping its slice.

  Args:
    model: the stage, embed and loss functions.
    spec: the static sizes of the tables the program runs (`ExecSpec.covering`).
    sharding: the mesh, its axes and the parameters' specs (`PipelineSharding`); a bare Mesh
      stands for `PipelineSharding(mesh)`.

  Returns:
    The jitted `run`, cached per (model, spec, sharding).

  Raises:
    TypeError: `sharding` is neither a PipelineSharding nor a Mesh.
    ValueError: the mesh, the axes or the specs do not fit `spec` or each other.
  """
  return _make_executor(model, spec, as_sharding(sharding))  # the type checked before the cache


@functools.lru_cache(maxsize=64)
def _make_executor(model: Model, spec: ExecSpec, sharding: PipelineSharding) -> Callable:
  """`make_executor` for a `PipelineSharding`, one program per (model, spec, sharding)."""
  _check_sharding(spec, sharding)
  scatter = None  # per stage leaf: (dimension of the chunk's leaf, data axes) or None
  if sharding.grad_key is not None:
    scatter = scatter_of(sharding.grad_key, sharding.param_key, sharding.token_axes)
  stage_fn = _stage_fn_of(model)
  plan = _TickPlan.of(spec)

  def body(table, links, local, xs, targets, head_params, embed_params, side, stages):
    rows = plan.rows(table[:, 0], links)
    rank = _RankProgram(
        model,
        stage_fn,
        spec,
        plan,
        sharding,
        _index(local, 0),
        xs,
        targets,
        head_params,
        embed_params,
        side,
        stages,
    )
    state, _ = lax.scan(rank.tick, rank.init_state(), rows)
    return rank.results(state, scatter)

  pp_axis, batch_axes, seq_axes = sharding.pp_axis, sharding.batch_axes, sharding.seq_axes
  batch_spec = io_spec(batch_axes, seq_axes)
  head_spec, embed_spec = (sharding.spec_tree(k) for k in (sharding.head_key, sharding.embed_key))
  mapped = jax.shard_map(
      body,
      mesh=sharding.mesh,
      in_specs=(
          P(None, pp_axis),
          P(),
          sharding.local_spec(sharding.param_key),
          batch_spec,
          batch_spec,
          head_spec,
          embed_spec,
          batch_spec,
          P(pp_axis),
      ),
      out_specs=(
          P(),
          sharding.local_spec(sharding.grad_key or sharding.param_key),
          head_spec,
          embed_spec,
      )
      + ((P(pp_axis, None, sharding.token_axes or None),) if model.stage_aux else ()),
      # The carries mix per-rank values with replicated ones and every part must return the
      # same types; the reductions at the end are explicit, so vma checking is off.
      check_vma=False,
  )

  def run(table, local_params, xs, targets, head_params, embed_params, side=(), stages=None):
    if stages is None:
      if model.unit_index:
        raise ValueError(
            "Model.unit_index needs `stages`, the model stage of each rank's chunks "
            "[ranks, chunks] (Lowered.layout())"
        )
      stages = jnp.zeros((spec.num_ranks, spec.chunks), jnp.int32)
    if sharding.param_key is not None:
      check_param_specs(
          sharding.param_key, batch_axes, seq_axes, pp_axis, local_params, sharding.model_axes
      )
    links = plan.links(table)
    stages = jnp.asarray(stages, jnp.int32)
    return mapped(table, links, local_params, xs, targets, head_params, embed_params, side, stages)

  return jax.jit(run)


def is_contiguous(layout) -> bool:
  """Whether rank r's chunks are model stages r·v .. r·v+v-1 in order (no copies): a reshape.

  Args:
    layout: the model stage of each rank's chunk, [ranks, chunks] (`Lowered.layout()`).

  Returns:
    True for a numpy layout equal to `arange(size)` in its shape; False otherwise, and for any
    non-numpy (e.g. traced) layout.
  """
  if not isinstance(layout, np.ndarray):
    return False
  return bool(np.array_equal(layout, np.arange(layout.size).reshape(layout.shape)))


def to_local(stage_params: PyTree, layout: np.ndarray) -> PyTree:
  """Stage-stacked params as each rank's chunks, copies of a stage included.

  A contiguous numpy layout is a reshape, so a stage stack already split over the pipeline axis
  stays in place; any other layout (or a traced one) is a gather, for which XLA moves the
  stages to their ranks.

  Args:
    stage_params: a pytree of leaves [stages, ...].
    layout: the model stage of each rank's chunk, [ranks, chunks] (`Lowered.layout()`).

  Returns:
    The pytree with leaves [ranks, chunks, ...].
  """
  if is_contiguous(layout):
    return jax.tree.map(lambda a: a.reshape(tuple(layout.shape) + a.shape[1:]), stage_params)
  idx = jnp.reshape(layout, (-1,))
  return jax.tree.map(lambda a: a[idx].reshape(tuple(layout.shape) + a.shape[1:]), stage_params)


def from_local(
    local_grads: PyTree, layout: np.ndarray, num_stages: int, model: Model | None = None
) -> PyTree:
  """Per-chunk gradients as stage-stacked ones, summing the gradients of a stage's copies.

  Args:
    local_grads: a pytree of leaves [ranks, chunks, ...].
    layout: the model stage of each rank's chunk, [ranks, chunks] (`Lowered.layout()`).
    num_stages: the number of model stages.
    model: the model whose `Model.max_grads` picks the leaves whose copies' gradients are
      combined by max instead of summed, or None.

  Returns:
    The pytree with leaves [num_stages, ...].
  """
  if is_contiguous(layout) and layout.size == num_stages:
    return jax.tree.map(lambda g: g.reshape((num_stages,) + g.shape[2:]), local_grads)
  idx = jnp.reshape(layout, (-1,))

  def gather(path, g):
    out = jnp.zeros((num_stages,) + g.shape[2:], g.dtype).at[idx]
    return (out.max if combines_by_max(model, path) else out.add)(g.reshape((-1,) + g.shape[2:]))

  return jax.tree_util.tree_map_with_path(gather, local_grads)


# --- measurement hook: jaxpipe.measure times these parts as the executor compiles them ---------


def stage_ops(
    model: Model,
    params: PyTree,
    x: jax.ShapeDtypeStruct,
    recompute: bool = False,
    side: PyTree = (),
) -> _StageOps:
  """The parts a tick runs on one stage, built as `make_executor` builds them.

  Args:
    model: the model whose stage function the parts run.
    params: one stage's params.
    x: the stage input's shape and dtype.
    recompute: store only stage inputs and recompute the forward in I, B and W.
    side: one micro-batch's side inputs (shapes); `()` without them.

  Returns:
    The parts (`forward`, `input_grad`, `weight_grad`, `full_grad`).
  """
  return _StageOps(_stage_fn_of(model), params, x, recompute, model, side)
