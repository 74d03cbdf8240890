"""Every parallel axis against every other: a pairwise-covering matrix of layouts (tp 1, 2, 4 x
pp 1, 2 x the data, expert and context axes x each `optimizer.shard`, sequence parallelism on
and off, dense and MoE) on 8 host devices. For each layout the loss and every gradient equal the
one-device model's, and three AdamW steps give the replicated run's losses and parameters.

Each layout compiles two programs, so the matrix runs with `-m slow`; CI keeps one layout of it
and the per-feature tests (tests/parallel/test_tensor.py, tests/training/test_zero.py), which
cover each axis with its neighbours.

    python -m pytest -m slow tests/parallel/test_layout_matrix.py
"""

import functools
from typing import NamedTuple

import jax
import numpy as np
import pytest

from configs import tiny
from jaxpipe.training import config as config_lib
from jaxpipe.training import zero
from jaxpipe.training.losses import make_loss_and_grads
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.state import state_shardings
from jaxpipe.training.trainer import Trainer
from tests import helpers


class Layout(NamedTuple):
  tp: int
  pp: int
  cp: int
  moe: bool  # MoE layers, experts over ep 2
  sp: bool  # model.sequence_parallel
  shard: str  # optimizer.shard

  def __str__(self):
    return "tp{}-pp{}-cp{}-{}{}-{}".format(
        self.tp,
        self.pp,
        self.cp,
        "moe-ep2" if self.moe else "dense",
        "-sp" if self.sp else "",
        self.shard,
    )


# Pairwise-covering: every pair of (tp, pp), (tp, shard), (pp, shard), (tp, sp), MoE with each tp,
# pp and sp setting, cp 2 with each tp and pp that leaves it heads to split. dp takes the devices
# left (8 / (tp pp cp ep)); the optimizer splits over dp, ep and cp.
MATRIX = [
    Layout(1, 1, 1, False, False, "zero1"),  # dp 8
    Layout(1, 1, 1, True, False, "fsdp"),  # ep 2 x dp 4
    Layout(1, 1, 2, False, False, "fsdp"),  # cp 2 x dp 4
    Layout(1, 2, 2, False, False, "zero2"),  # dp 2
    Layout(1, 2, 1, True, False, "zero1"),  # ep 2 x dp 2
    Layout(2, 1, 2, False, True, "zero2"),  # dp 2
    Layout(2, 1, 1, True, False, "zero1"),  # ep 2 x dp 2
    Layout(2, 1, 1, False, False, "fsdp"),  # dp 4
    Layout(2, 1, 1, False, True, "none"),  # dp 4
    Layout(2, 1, 2, False, False, "zero1"),  # dp 2
    Layout(2, 2, 1, False, True, "fsdp"),  # dp 2
    Layout(2, 2, 1, True, True, "zero2"),  # ep 2: the data split is ep's
    Layout(2, 2, 2, False, False, "none"),  # tp x cp x pp
    Layout(4, 1, 1, False, True, "zero2"),  # dp 2; 2 KV heads whole on each rank
    Layout(4, 1, 1, False, False, "zero1"),  # dp 2
    Layout(4, 1, 1, True, True, "fsdp"),  # ep 2
    Layout(4, 2, 1, False, True, "none"),
    Layout(1, 2, 2, False, False, "fsdp"),  # dp 2: fsdp's per-layer gathers beside cp in stages
    Layout(1, 2, 1, True, False, "fsdp"),  # ep 2 x dp 2: experts gathered over dp in stages
]
IN_CI = {"tp2-pp2-cp1-moe-ep2-sp-zero2"}  # the layout no per-feature test has: every axis but cp


def _config(layout: Layout | None, moe: bool, microbatches: int, kv_heads: int):
  """The layout's config; None: the replicated reference (dp 8, shard none) of the same model."""
  if moe:  # dropless and no auxiliary losses: a token's gradient does not depend on its batch
    c = helpers.moe_config(ep=2, lb_loss_coef=0.0, z_loss_coef=0.0, every=1)
    c.model.n_layers = 2
  else:
    c = tiny.get_config()
  c.data.batch = 16  # dp 8 x 2 micro-batches in the reference
  c.train.steps = 3
  c.pipeline.microbatches = microbatches  # gradient accumulation at pp 1
  c.model.n_kv_heads = kv_heads
  if layout is None:
    c.mesh.ep = 1
    return c
  c.mesh.tp, c.mesh.pp, c.mesh.cp = layout.tp, layout.pp, layout.cp
  c.model.sequence_parallel = layout.sp
  c.optimizer.shard = layout.shard
  if layout.pp > 1:
    c.pipeline.schedule = "1f1b"
  return c


@functools.cache
def _three_steps(layout: Layout | None, moe: bool, microbatches: int, kv_heads: int):
  """(losses, model-order parameters) after three steps."""
  trainer = Trainer(_config(layout, moe, microbatches, kv_heads))
  trainer.init()
  losses = [float(trainer.step()["loss"]) for _ in range(3)]
  return losses, jax.device_get(trainer.model_params())


def _param(layout: Layout):
  marks = () if str(layout) in IN_CI else (pytest.mark.slow,)
  return pytest.param(layout, marks=marks, id=str(layout))


@pytest.mark.parametrize("layout", [_param(l) for l in MATRIX])
def test_layout_equals_the_one_device_model_and_the_replicated_trajectory(layout):
  m = 2 if layout.pp > 1 else 1
  kv = 4 if layout.cp > 1 else 2  # Ulysses splits each tp rank's heads over cp
  c = _config(layout, layout.moe, m, kv)
  shape = config_lib.validate(c, jax.device_count())
  assert shape["dp"] * shape["ep"] * layout.tp * layout.pp * layout.cp == 8
  cfg = config_lib.model_config(c)
  assert cfg.moe is None or cfg.moe.dispatch == "dropless"
  mesh = make_mesh(c.mesh)
  params = helpers.random_params(cfg)
  split = layout.shard in ("zero2", "fsdp")  # the gradient step takes them as stored
  placed = jax.device_put(
      params, zero.data_split(params, mesh) if split else state_shardings(params, mesh)
  )
  batch = helpers.random_batch(c)
  loss, grads, _ = jax.jit(make_loss_and_grads(c, cfg, shape))(placed, batch)
  helpers.assert_one_device(cfg, params, batch, loss, grads, microbatches=m)

  losses, got = _three_steps(layout, layout.moe, m, kv)
  want_losses, want = _three_steps(None, layout.moe, m, kv)  # the same model, replicated
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want)
  for path, p in helpers.flat(got).items():
    helpers.close(p, want[path], f"{layout}: {jax.tree_util.keystr(path)}", rtol=1e-5)


def test_the_matrix_covers_every_pair():
  """Each pair of values of two factors appears in some layout (a layout the devices admit)."""
  pairs = lambda f, g: {(f(l), g(l)) for l in MATRIX}
  tp, pp, cp = (lambda l: l.tp), (lambda l: l.pp), (lambda l: l.cp)
  shard, sp, moe = (lambda l: l.shard), (lambda l: l.sp), (lambda l: l.moe)
  assert pairs(tp, pp) == {(t, p) for t in (1, 2, 4) for p in (1, 2)}
  assert pairs(pp, shard) == {(p, s) for p in (1, 2) for s in zero.MODES}
  for t in (2, 4):  # zero splits need a data axis: tp 4 leaves dp 2 only at pp 1
    assert {s for (x, s) in pairs(tp, shard) if x == t} >= set(zero.MODES) - {"none"}
  assert pairs(tp, sp) >= {(t, s) for t in (2, 4) for s in (False, True)}
  assert pairs(moe, tp) == {(o, t) for o in (False, True) for t in (1, 2, 4)}
  assert pairs(moe, pp) == {(o, p) for o in (False, True) for p in (1, 2)}
  assert pairs(moe, sp) == {(o, s) for o in (False, True) for s in (False, True)}
  assert {(t, p) for (t, p, c) in ((l.tp, l.pp, l.cp) for l in MATRIX) if c == 2} == {
      (1, 1),
      (1, 2),
      (2, 1),
      (2, 2),
  }
  assert {s for (c, s) in pairs(cp, shard) if c == 2} == set(zero.MODES)
  assert {str(l) for l in MATRIX} >= IN_CI
