"""Chimera and DualPipe in the trainer: two resident copies of every layer, as both papers keep.

Each rank stores the two stages it runs (twice the parameter and moment memory), the copies'
gradients are summed by one ppermute between their two holders, both copies take the same
update and stay bit-identical, the clipping norm counts each parameter once, and checkpoints
hold the model's order. The oracle is the unpipelined trainer (pp = 1, the whole batch at once),
which 1F1B equals (tests/training/test_pipeline_lm.py).
"""

import jax
import numpy as np
import pytest

from configs import tiny
from jaxpipe.training.trainer import Trainer

STEPS = 3
SCHEDULES = ("chimera", "dualpipe")


def tiny_config(pp, schedule, microbatches=4):
  c = tiny.get_config()  # 2 layers: one model stage per rank at pp = 2
  c.mesh.pp = pp
  c.pipeline.schedule = schedule
  c.pipeline.microbatches = microbatches  # DualPipe needs 2p
  return c


def run(trainer):
  """STEPS steps on batches 0, 1, ...; -> [(loss, grad_norm)] and the compiled step's HLO."""
  state = trainer.init()
  compiled = trainer.build_train_step().lower(state, trainer.batch(0)).compile()
  trainer._train_step = compiled
  metrics = [trainer.step(trainer.batch(i)) for i in range(STEPS)]
  return [(float(m["loss"]), float(m["grad_norm"])) for m in metrics], compiled.as_text()


@pytest.fixture(scope="module")
def reference():
  trainer = Trainer(tiny_config(1, "1f1b", microbatches=1))  # dp = 8, the whole batch at once
  return trainer, run(trainer)[0]


@pytest.fixture(scope="module", params=SCHEDULES)
def copied(request, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp(request.param))
  trainer = Trainer(tiny_config(2, request.param), workdir=workdir)
  metrics, hlo = run(trainer)
  trainer.checkpointer.save(STEPS, trainer._checkpoint_state())
  trainer.checkpointer.wait()
  return trainer, metrics, hlo, workdir


def test_same_losses_gradients_and_updates_as_unpipelined(copied, reference):
  trainer, metrics, _, _ = copied
  ref_trainer, ref_metrics = reference
  np.testing.assert_allclose(metrics, ref_metrics, rtol=1e-5)  # loss, and the norm counted once
  # Adam's moments are running sums of the gradients: equal moments, equal gradients every step
  got = jax.device_get(trainer._checkpoint_state())
  want = jax.device_get(ref_trainer.state)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-6 * max(1.0, np.max(np.abs(b))), err_msg=jax.tree_util.keystr(path)
    )


def test_each_rank_stores_both_copies_and_they_stay_equal(copied):
  """Rank r stores the layers of the two stages it runs (one per pipeline): twice the model's
  layers over the pipeline, params and moments, each copy equal to the other bit for bit."""
  from jaxpipe.training.pipeline_lm import lm_schedule

  trainer, _, _, _ = copied
  order, units, pp = trainer.layer_order, trainer.model_cfg.n_layers, trainer.mesh.shape["pp"]
  placement = lm_schedule(trainer.config.pipeline, pp).placement
  per_stage = units // placement.num_stages
  state = trainer.state
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  layers = [(p, x) for p, x in flat if "'layers'" in jax.tree_util.keystr(p)]
  assert len(layers) == 3 * len(jax.tree.leaves(state.params["layers"]))  # params, mu, nu
  for r in range(pp):
    stages = [placement.stage_model[s] for s in placement.rank_stages(r)]
    runs = [s * per_stage + u for s in stages for u in range(per_stage)]
    assert order[r * len(order) // pp : (r + 1) * len(order) // pp].tolist() == runs
  for path, x in layers:
    assert x.shape[0] == 2 * units
    for shard in x.addressable_shards:
      r = int(np.argwhere(trainer.mesh.devices == shard.device)[0][0])  # pp is the first axis
      assert shard.index[0] == slice(r * 2 * units // pp, (r + 1) * 2 * units // pp)
    host = np.asarray(jax.device_get(x))
    for unit in range(units):
      first, second = np.flatnonzero(order == unit)
      np.testing.assert_array_equal(host[first], host[second], err_msg=jax.tree_util.keystr(path))


def test_step_moves_no_parameters_only_one_gradient_sum(copied):
  from experiments.pipeline_traffic import _permutes

  trainer, _, hlo, _ = copied
  permutes = _permutes(hlo)
  kinds = {kind for _, kind in permutes}
  assert "copies" in kinds and kinds <= {"send_down", "send_up", "copies"}  # nothing else moves
  summed = sum(b for b, kind in permutes if kind == "copies")
  # one rank's layer gradients, both of its stages, cross once
  layer_bytes = sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.state.params["layers"])
  )
  assert summed == layer_bytes // trainer.mesh.shape["pp"]


def test_checkpoint_resumes_copies_and_restores_into_a_contiguous_schedule(copied):
  trainer, _, _, workdir = copied
  want = jax.device_get(trainer.state)
  again = Trainer(tiny_config(2, trainer.config.pipeline.schedule), workdir=workdir)
  resumed = jax.device_get(again.init())
  assert again.resumed_from == STEPS
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(resumed)[0], jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  plain = Trainer(tiny_config(2, "1f1b"), workdir=workdir)
  assert plain.layer_order is None
  restored = jax.device_get(plain.init())
  for a, b in zip(
      jax.tree.leaves(restored), jax.tree.leaves(jax.device_get(trainer._checkpoint_state()))
  ):
    np.testing.assert_array_equal(a, b)


def test_copy_partners_of_a_placement():
  from jaxpipe.pipeline import make_schedule
  from jaxpipe.pipeline.api import copy_partners
  from jaxpipe.pipeline.ir.lower import lower

  layout = lower(make_schedule("chimera", pp=4, microbatches=8)).layout()
  assert layout.tolist() == [[0, 3], [1, 2], [2, 1], [3, 0]]
  pairs, chunks = copy_partners(layout)
  assert pairs == ((3, 0), (2, 1), (1, 2), (0, 3))  # rank r's copies sit on rank 3 - r
  assert chunks == ((1, 0),) * 4  # in its other chunk
  assert copy_partners(np.arange(8).reshape(4, 2)) is None
  with pytest.raises(ValueError, match="each rank's partners on one rank"):
    copy_partners(np.array([[0, 1], [1, 2], [2, 0]]))
  with pytest.raises(ValueError, match="stage 0 has 3 copies"):
    copy_partners(np.array([[0, 0], [0, 1], [1, 1]]))
