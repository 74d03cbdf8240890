"""Executor: every schedule's loss and gradients equal unpipelined jax.value_and_grad."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import op_breakdown
from jaxpipe.pipeline import SCHEDULE_NAMES, make_schedule
from jaxpipe.pipeline.executor import ExecSpec, Model, from_local, layered, make_executor, to_local
from jaxpipe.pipeline.ir.lower import CHANNELS, COL, LowerOptions, lower

B, L, D = 2, 4, 8  # micro-batch, sequence, width: tiny, so compiling dominates


def stage_fn(params, x_BxLxD):
  return jnp.tanh(x_BxLxD @ params["w"] + params["b"])


def loss_fn(head_params, y_BxLxD, t_BxLxD):
  return jnp.sum((y_BxLxD - t_BxLxD) ** 2)


MODEL = Model(stage_fn, loss_fn)
# Two layers per stage, seen layer by layer: I keeps per-layer cotangents for W.
LAYERED = Model(layered(stage_fn), loss_fn)


def build(name, p, m):
  return make_schedule(name, pp=p, microbatches=m, chunks=2 if name == "interleaved-1f1b" else None)


def mesh_for(p, dp):
  devices = np.array(jax.devices()[: p * (2 if dp else 1)])
  auto = jax.sharding.AxisType.Auto
  if dp:
    return jax.sharding.Mesh(devices.reshape(2, p), ("dp", "pp"), axis_types=(auto, auto))
  return jax.sharding.Mesh(devices, ("pp",), axis_types=(auto,))


@functools.cache
def schedules(p):
  """Every schedule and micro-batch count the tests run at p ranks -> lowered tables."""
  out = {}
  for name in SCHEDULE_NAMES:
    for m in (p, 2 * p, 3 * p):
      try:
        out[name, m] = lower(build(name, p, m))
      except ValueError:
        assert m == p, (name, p, m)  # only DualPipe-style schedules refuse m = p
  return out


@functools.cache
def executor(p, chunks, dp, recompute=False, model=MODEL):
  """One compiled program for every schedule with p ranks and `chunks` per rank."""
  group = [lo for lo in schedules(p).values() if lo.schedule.placement.chunks_per_rank == chunks]
  spec = ExecSpec.covering(group, recompute=recompute)
  return spec, make_executor(model, spec, mesh_for(p, dp))


@functools.cache
def data(num_stages, p, layers=()):
  """Parameters for num_stages stages and inputs for 3p micro-batches (runs use a prefix)."""
  rng = np.random.default_rng(num_stages * 100 + p)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  params = {
      "w": f32(rng.normal(size=(num_stages, *layers, D, D)) / np.sqrt(D)),
      "b": f32(0.1 * rng.normal(size=(num_stages, *layers, D))),
  }
  xs = f32(rng.normal(size=(3 * p, B, L, D)))
  ts = f32(rng.normal(size=(3 * p, B, L, D)))
  return params, xs, ts


@jax.jit
def reference(params, xs, ts, mask):
  """Unpipelined: loss summed over the micro-batches in `mask`, layers applied in order."""

  def total(params):
    flat = {"w": params["w"].reshape(-1, D, D), "b": params["b"].reshape(-1, D)}

    def one(x, t):
      def layer(x, ps):
        return stage_fn(ps, x), None

      y, _ = jax.lax.scan(layer, x, flat)
      return loss_fn((), y, t)

    return jnp.sum(jax.vmap(one)(xs, ts) * mask)

  return jax.value_and_grad(total)(params)


def run(name, p, m, dp, recompute=False, model=MODEL):
  lowered = schedules(p)[name, m]
  chunks = lowered.schedule.placement.chunks_per_rank
  spec, fn = executor(p, chunks, dp, recompute, model)
  spec.check(lowered)
  num_stages = lowered.schedule.num_stages
  params, xs, ts = data(num_stages, p, (2,) if model is LAYERED else ())
  layout = lowered.layout()
  loss, local_grads, _, _ = fn(
      lowered.padded(spec.num_ticks), to_local(params, layout), xs, ts, (), ()
  )
  grads = from_local(local_grads, layout, num_stages)
  mask = (jnp.arange(3 * p) < m).astype(jnp.float32)
  want_loss, want_grads = reference(params, xs, ts, mask)
  return loss, grads, want_loss, want_grads


def assert_close(got, want, rtol=1e-5):
  got, want = np.asarray(got), np.asarray(want)
  scale = np.max(np.abs(want))
  assert np.max(np.abs(got - want)) <= rtol * scale, (np.max(np.abs(got - want)), scale)


@pytest.mark.parametrize("dp", [False, True], ids=["pp", "dp2"])
@pytest.mark.parametrize("mult", [1, 2, 3], ids=["m=p", "m=2p", "m=3p"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_schedule_matches_unpipelined_value_and_grad(name, p, mult, dp):
  if (name, p * mult) not in schedules(p):
    pytest.skip(f"{name} forbids m={p * mult} at p={p}")
  loss, grads, want_loss, want_grads = run(name, p, p * mult, dp)
  assert_close(loss, want_loss)
  for k in want_grads:
    assert_close(grads[k], want_grads[k])
  # the first and last stages got gradients (catches dropped boundary work)
  assert np.all(np.abs(np.asarray(grads["w"])).sum(axis=(1, 2)) > 0)


@pytest.mark.parametrize("name", ["zb-h2", "dualpipev"])
def test_recompute_gives_the_same_gradients(name):
  loss, grads, want_loss, want_grads = run(name, 2, 4, False, recompute=True)
  assert_close(loss, want_loss)
  for k in want_grads:
    assert_close(grads[k], want_grads[k])


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_layered_stages_match_unpipelined_value_and_grad(name):
  loss, grads, want_loss, want_grads = run(name, 4, 8, False, model=LAYERED)
  assert_close(loss, want_loss)
  for k in want_grads:
    assert_close(grads[k], want_grads[k])


def test_layered_stages_with_recompute():
  loss, grads, want_loss, want_grads = run("zb-v", 2, 4, True, recompute=True, model=LAYERED)
  assert_close(loss, want_loss)
  for k in want_grads:
    assert_close(grads[k], want_grads[k])


def _runs_per_instruction(compiled, args, trace_dir):
  """{HLO instruction name: times it ran on all devices} in one call, from a profiler trace."""
  jax.block_until_ready(compiled(*args))
  with jax.profiler.trace(str(trace_dir)):
    jax.block_until_ready(compiled(*args))
  (path,) = trace_dir.glob("**/*.xplane.pb")
  return op_breakdown.exclusive_times(str(path))[1]


def test_parts_and_sends_run_only_in_the_ticks_that_need_them(tmp_path):
  # Every backward split into I and W ticks, one part per tick: F, I and W each run one matmul
  # (x @ w, dy @ w.T, x.T @ dy) per action, and I skips its matmul on the first stage, whose
  # input cotangent nothing reads.
  p, m = 4, 4
  lowered = lower(build("1f1b", p, m), variants=(LowerOptions(split="all", pack=False),))
  spec = ExecSpec.covering([lowered])
  params, xs, ts = data(p, p)
  args = (lowered.table, to_local(params, lowered.layout()), xs[:m], ts[:m], (), ())
  compiled = make_executor(MODEL, spec, mesh_for(p, False)).lower(*args).compile()
  hlo = compiled.as_text()
  op_names = dict(re.findall(r'%([\w.\-]+) = .*op_name="([^"]*)"', hlo))
  of_kind = lambda want: [n for n, (kind, _) in op_breakdown.op_kinds(hlo).items() if kind == want]
  matmuls = of_kind("matmul")
  runs = _runs_per_instruction(compiled, args, tmp_path)
  ran = {
      part: sum(runs[name] for name in matmuls if f"/tick/{part}/" in op_names.get(name, ""))
      for part in ("F", "I", "W")
  }
  kinds = [a.kind for tick in lowered.ticks for parts in tick for a in parts]
  assert "B" not in kinds and kinds.count("F") == kinds.count("W") == m * p
  # all matmuls are in the parts, none hoisted to run on every tick
  assert ran == {"F": m * p, "I": m * (p - 1), "W": m * p}
  assert sum(runs[name] for name in matmuls) == sum(ran.values())
  # One ppermute down (activations), one up (cotangents), each run on every rank in exactly
  # the ticks where some rank receives over it.
  assert lowered.channels == tuple(c in ("act_down", "grad_up") for c in CHANNELS)
  table = lowered.table
  receiving = sum(
      int(np.any(table[:, :, COL[f"recv_{c}"]] >= 0, axis=1).sum()) for c in ("act_down", "grad_up")
  )
  assert (
      0
      < receiving * p
      == sum(runs[name] for name in of_kind("ppermute"))
      < lowered.num_ticks * p * sum(lowered.channels)
  )


def test_same_rank_moves_compile_only_where_a_table_has_them():
  # A same-rank move (V shapes) is a 0/1-trip loop on every rank in every tick: tables without
  # such moves (1F1B) compile none, with the same results bit for bit.
  p, m = 2, 4
  lowered = schedules(p)["1f1b", m]
  spec = ExecSpec.covering([lowered])
  assert spec.local_moves == (False, False)
  zbv = schedules(p)["zb-v", m]
  zbv_spec = ExecSpec.covering([zbv])
  assert zbv_spec.local_moves == (True, True)
  params, xs, ts = data(p, p)
  args = (lowered.table, to_local(params, lowered.layout()), xs[:m], ts[:m], (), ())
  mesh = mesh_for(p, False)
  got, whiles = {}, {}
  for moves in ((False, False), (True, True)):
    compiled = (
        make_executor(MODEL, dataclasses.replace(spec, local_moves=moves), mesh)
        .lower(*args)
        .compile()
    )
    whiles[moves] = len(re.findall(r" while\(", compiled.as_text()))
    got[moves] = jax.tree.leaves(compiled(*args))
  assert whiles[True, True] - whiles[False, False] == 2
  for a, b in zip(got[False, False], got[True, True]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="within a rank"):
    dataclasses.replace(zbv_spec, local_moves=(False, True)).check(zbv)
