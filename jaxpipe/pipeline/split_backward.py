"""A layer's backward split into the half the input cotangent needs (I) and the rest (W).

A zero-bubble schedule runs a layer's backward in two parts at different ticks: I, which the
previous stage waits for, computes the input cotangent; W, which nobody waits for, computes the
weight cotangents. Re-deriving W from the layer's output cotangent would run most of the
layer's backward twice (everything between the output and each weight: the attention backward,
the activation function's). Instead the backward is traced once, to a jaxpr, and its equations
are split: I runs every equation the input cotangent needs and hands W the values W's own
equations read from them (for a transformer layer the cotangents at each weight product's
output: q, k, v, the MLP's gate and up, the two products into the residual stream); W runs
only the equations that feed the weight cotangents alone and touch a weight product: the
products `x.T @ dy` and what feeds or follows them. The rest of the weight cotangents' work
(a norm's scale cotangent, a bias's: a reduction to one value per feature) runs in I, which
keeps those few values rather than their per-token inputs. Together they run each equation of
the backward once, so I + W costs what one full backward does, plus storing what I hands on.

Calls (`jit` inside a layer) and remat blocks (`jax.checkpoint`: FSDP's gathered layer
recomputes its gathers in the backward) are inlined first, so that a body whose outputs feed
both halves is split too; any other equation (a loop, a custom call) is kept whole, in I when
the input cotangent needs any of its outputs (W then reads what it computed). An optimization
barrier is followed operand by operand and split between the halves (the backward of a
forward's tie joins cotangents that only one half needs). Equations with effects other than a
collective's stay in I.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core

PyTree = Any

_NAME = "split_backward"
_BARRIER = "optimization_barrier"
# primitives that are, or may hold, a matrix product (W keeps them and what touches them)
_PRODUCTS = (
    "dot_general",
    "ragged_dot",
    "conv_general",
    "pallas_call",
    "custom_call",
    "triton",
    "mosaic",
)
# inlined: their bodies' equations are split
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2")


def _is_var(a) -> bool:
  return isinstance(a, core.Var) and not isinstance(a, core.DropVar)


def _pinned(eqn) -> bool:
  """Whether `eqn` has effects beyond naming mesh axes (a collective's): it then runs in I."""
  return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _body(eqn):
  """(jaxpr, consts) of an equation to inline: a call, or a remat block (in a backward its only
  effect is to keep XLA from merging its recomputation with the forward's, which is already
  apart); None for any other."""
  if eqn.primitive.name not in _CALLS or _pinned(eqn):
    return None
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(body, core.ClosedJaxpr):
    return body.jaxpr, body.consts
  if isinstance(body, core.Jaxpr) and not body.constvars:
    return body, []
  return None


def _inline(jaxpr, sub: dict, consts: list, constvars: list) -> tuple[list, list]:
  """The equations of `jaxpr` with call equations replaced by their bodies, every variable but
  the inputs renamed fresh (a body inlined twice gets two sets), and `sub` mapping `jaxpr`'s
  variables to the outer ones. Inner constants are appended to `consts`/`constvars`. -> (eqns,
  outvars)."""
  read = lambda a: sub.get(a, a) if _is_var(a) else a
  eqns = []
  for eqn in jaxpr.eqns:
    invars = [read(a) for a in eqn.invars]
    body = _body(eqn)
    if body is not None:
      body_jaxpr, body_consts = body
      inner = dict(zip(body_jaxpr.invars, invars))
      for v, c in zip(body_jaxpr.constvars, body_consts):
        fresh = core.Var(v.aval)
        constvars.append(fresh)
        consts.append(c)
        inner[v] = fresh
      body, outs = _inline(body_jaxpr, inner, consts, constvars)
      eqns += body
      for v, o in zip(eqn.outvars, outs):
        if _is_var(v):
          sub[v] = o
      continue
    outvars = []
    for v in eqn.outvars:
      if _is_var(v):
        sub[v] = core.Var(v.aval)
        outvars.append(sub[v])
      else:
        outvars.append(v)
    eqns.append(eqn.replace(invars=invars, outvars=outvars))
  return eqns, [read(a) for a in jaxpr.outvars]


def _live(eqns: Sequence, roots) -> list[frozenset[int]]:
  """Per equation: the indices of its outputs that some variable in `roots` depends on (all of
  them for a pinned one). An optimization barrier is followed operand by operand: its outputs
  are its operands, and the barrier a backward makes of a forward's tie (a layer's gathered
  weights tied to its input) joins the weight cotangents, which only W needs, to the input
  cotangent."""
  want = {v for v in roots if _is_var(v)}
  out = []
  for eqn in reversed(eqns):
    outs = range(len(eqn.outvars))
    live = frozenset(outs if _pinned(eqn) else (k for k in outs if eqn.outvars[k] in want))
    if live and eqn.primitive.name == _BARRIER:
      want.update(eqn.invars[k] for k in live if _is_var(eqn.invars[k]))
    elif live:
      want.update(a for a in eqn.invars if _is_var(a))
    out.append(live)
  return out[::-1]


def _restricted(eqns: Sequence, live: Sequence[frozenset[int]]) -> list:
  """The equations with live outputs, a barrier reduced to those operands."""
  out = []
  for eqn, keep in zip(eqns, live):
    if keep and eqn.primitive.name == _BARRIER and len(keep) < len(eqn.outvars):
      keep = sorted(keep)
      eqn = eqn.replace(
          invars=[eqn.invars[k] for k in keep], outvars=[eqn.outvars[k] for k in keep]
      )
    if keep:
      out.append(eqn)
  return out


def _is_product(eqn) -> bool:
  """A matrix product, or anything that may hold one (a kernel, a custom call, a loop): I takes
  over none of these from W, nor what feeds or follows them."""
  name = eqn.primitive.name
  return name.startswith(_PRODUCTS) or any(True for _ in core.jaxprs_in_params(eqn.params))


def _outside_products(w_eqns: Sequence) -> tuple[list, list]:
  """(W's equations I may run instead, the rest): those that neither feed nor follow one of W's
  matrix products and read only what I has (a norm's scale cotangent, a bias's: reductions to
  one value per feature, whose per-token inputs I would otherwise keep for W)."""
  made = [{v for v in e.outvars if _is_var(v)} for e in w_eqns]
  near = [_is_product(e) for e in w_eqns]
  after = set()  # values that follow a product
  for k, e in enumerate(w_eqns):
    if near[k] or any(a in after for a in e.invars if _is_var(a)):
      near[k] = True
      after |= made[k]
  feeding = set()  # values a product (or what feeds it) reads
  for k in range(len(w_eqns) - 1, -1, -1):
    if near[k] or made[k] & feeding:
      near[k] = True
      feeding.update(a for a in w_eqns[k].invars if _is_var(a))
  moved, kept, in_w = [], [], set()
  for k, e in enumerate(w_eqns):
    if near[k] or any(a in in_w for a in e.invars if _is_var(a)):
      kept.append(e)
      in_w |= made[k]
    else:
      moved.append(e)
  return moved, kept


@dataclasses.dataclass(frozen=True)
class SplitBackward:
  """`backward(stored, params, g) -> (dparams, dx)` as I and W halves; see the module docstring.

  kept: shapes of what `input_half` hands `weight_half` (per micro-batch).
  """

  kept: tuple[jax.ShapeDtypeStruct, ...]
  _input: Callable  # (flat stored+params+g, need_dx) -> (dx, kept)
  _weight: Callable  # (flat stored+params, kept) -> flat dparams
  _dp_tree: Any  # treedef of dparams

  def input_half(self, stored, params, g, need_dx: bool = True):
    """Runs I: the input cotangent, and what W reads from I's equations.

    Args:
      stored: the stored residuals `backward` reads, shaped as `split_backward` traced them.
      params: the layer's parameters, shaped as traced.
      g: the layer's output cotangent, shaped as traced.
      need_dx: whether the input cotangent is needed (a bool, or a traced bool: then both
        variants are compiled under a `lax.cond`); without it dx is zeros and only what W needs
        is computed.

    Returns:
      `(dx, kept)`: the input cotangent (shaped as `backward`'s dx) and a list of arrays shaped
      as `self.kept`.
    """
    flat = jax.tree.leaves((stored, params, g))
    return self._input(flat, need_dx)

  def weight_half(self, stored, params, kept) -> PyTree:
    """Runs W: the weight cotangents from what `input_half` kept.

    Args:
      stored: the stored residuals `backward` reads, shaped as `split_backward` traced them.
      params: the layer's parameters, shaped as traced.
      kept: the arrays `input_half` returned, shaped as `self.kept`.

    Returns:
      dparams, a pytree like `backward`'s.
    """
    flat = jax.tree.leaves((stored, params))
    return jax.tree.unflatten(self._dp_tree, self._weight(flat, list(kept)))


def split_backward(backward: Callable, stored, params, g) -> SplitBackward:
  """Traces `backward(stored, params, g) -> (dparams, dx)` and splits it (module docstring).

  Args:
    backward: `(stored, params, g) -> (dparams, dx)`, one layer's backward.
    stored: the stored residuals it reads (arrays or shapes).
    params: the layer's parameters (arrays or shapes).
    g: the layer's output cotangent (arrays or shapes).

  Returns:
    The `SplitBackward`, whose `input_half` and `weight_half` take arguments of the same
    structure and shapes.
  """
  closed, shapes = jax.make_jaxpr(backward, return_shape=True)(stored, params, g)
  dp_shapes, dx_shape = shapes
  n_dp = len(jax.tree.leaves(dp_shapes))
  jaxpr = closed.jaxpr
  consts, constvars = list(closed.consts), list(jaxpr.constvars)
  eqns, outvars = _inline(jaxpr, {}, consts, constvars)
  dp_out, (dx_out,) = outvars[:n_dp], outvars[n_dp:]
  n_g = len(jax.tree.leaves(g))
  invars = list(jaxpr.invars)
  w_inputs = set(invars[: len(invars) - n_g]) | set(constvars)  # W reads these directly

  in_i = _live(eqns, [dx_out])
  in_w = [w - i for w, i in zip(_live(eqns, dp_out), in_i)]
  # an equation I runs whole hands W all its outputs; only a barrier's other operands remain
  in_w = [
      w if not i or e.primitive.name == _BARRIER else frozenset()
      for e, w, i in zip(eqns, in_w, in_i)
  ]
  w_eqns = _restricted(eqns, in_w)
  moved, w_eqns = _outside_products(w_eqns)
  made_by_w = {v for e in w_eqns for v in e.outvars if _is_var(v)}
  kept, seen = [], set()
  for a in [a for e in w_eqns for a in e.invars] + list(dp_out):
    if _is_var(a) and a not in made_by_w and a not in w_inputs and a not in seen:
      seen.add(a)
      kept.append(a)
  i_eqns = _restricted(eqns, in_i) + moved
  i_only_kept = _restricted(i_eqns, _live(i_eqns, kept))

  def make(ins, outs, es):
    effects = frozenset().union(*(e.effects for e in es))
    return core.Jaxpr(constvars, ins, outs, es, effects, core.DebugInfo(_NAME, _NAME, None, None))

  run = lambda jaxpr: core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, consts))
  i_full = run(make(invars, [dx_out] + kept, i_eqns))
  i_kept = run(make(invars, kept, i_only_kept))
  w_half = run(make(invars[: len(invars) - n_g] + kept, dp_out, w_eqns))
  zeros_dx = lambda: jax.numpy.zeros(dx_shape.shape, dx_shape.dtype)

  def input_fn(flat, need_dx):
    if need_dx is True:
      dx, *k = i_full(*flat)
      return dx, k
    if need_dx is False:
      return zeros_dx(), list(i_kept(*flat))
    return jax.lax.cond(need_dx, lambda: input_fn(flat, True), lambda: input_fn(flat, False))

  def weight_fn(flat, k):
    return w_half(*flat, *k)

  return SplitBackward(
      tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in kept),
      input_fn,
      weight_fn,
      jax.tree.structure(dp_shapes),
  )
