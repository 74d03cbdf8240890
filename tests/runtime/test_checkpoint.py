"""Checkpoints: restore onto the current mesh, keep-last-N, unfinished/corrupt steps,
exact resume."""

import json
import os
import shutil
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import tiny
from jaxpipe.runtime.checkpoint import Checkpointer
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.trainer import Trainer

# Orbax leaves the reads of a failed restore to be garbage-collected; their errors are expected
# here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _tree(step):
  return {"w": jnp.arange(32.0).reshape(8, 4) * step, "b": jnp.full((4,), step, jnp.int32)}


def _abstract(tree, sharding=None):
  """Shapes of `tree`; `w` with `sharding`, the rest replicated like it."""
  return {
      k: jax.ShapeDtypeStruct(
          x.shape,
          x.dtype,
          sharding=sharding if k == "w" else (sharding and NamedSharding(sharding.mesh, P())),
      )
      for k, x in tree.items()
  }


def test_restore_onto_another_sharding_and_keep_last(tmp_path):
  mesh = make_mesh(tiny.get_config().mesh)
  ckpt = Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, jax.device_put(_tree(step), NamedSharding(mesh, P())))
  ckpt.wait()
  assert ckpt.steps() == [2, 3]
  # Saved replicated, restored split over the data axis.
  step, tree = Checkpointer(str(tmp_path), keep=2).restore_latest(
      _abstract(_tree(0), NamedSharding(mesh, P("dp")))
  )
  assert step == 3
  assert tree["w"].sharding.spec == P("dp") and tree["w"].addressable_shards[0].data.shape == (1, 4)
  np.testing.assert_array_equal(tree["w"], _tree(3)["w"])
  np.testing.assert_array_equal(tree["b"], _tree(3)["b"])


def _save_steps(directory, steps):
  ckpt = Checkpointer(directory, keep=10)
  for s in steps:
    ckpt.save(s, _tree(s))
  ckpt.close()


def _corrupt(step_dir):
  """Overwrites every data file of a committed step with garbage (markers left in place)."""
  for root, _, files in os.walk(step_dir):
    for f in files:
      if f not in ("commit_success.txt", "_CHECKPOINT_METADATA"):
        with open(os.path.join(root, f), "wb") as fh:
          fh.write(b"\x00garbage")


def test_unfinished_and_corrupt_steps_are_not_latest(tmp_path):
  d = str(tmp_path)
  _save_steps(d, [2, 4, 6])
  os.makedirs(os.path.join(d, "9"))  # half-copied: a step directory with no commit marker
  os.makedirs(os.path.join(d, "8.orbax-checkpoint-tmp-1700000000"))  # orbax write interrupted
  _corrupt(os.path.join(d, "6"))
  listed = sorted(os.listdir(d))
  reader = Checkpointer(d, keep=10, read_only=True)  # beside a run that may be writing: no renames
  step, tree = reader.restore_latest(_abstract(_tree(0)))
  assert step == 4 and reader.steps() == [2, 4, 6] and sorted(os.listdir(d)) == listed
  np.testing.assert_array_equal(tree["w"], _tree(4)["w"])
  with pytest.raises(ValueError, match="opened read-only"):
    reader.save(7, _tree(7))
  reader.close()
  assert sorted(os.listdir(d)) == listed
  ckpt = Checkpointer(d, keep=10)
  assert ckpt.steps() == [2, 4, 6]  # 9 never committed: set aside at once
  step, tree = ckpt.restore_latest(_abstract(_tree(0)))
  assert step == 4
  np.testing.assert_array_equal(tree["w"], _tree(4)["w"])
  assert ckpt.steps() == [2, 4]
  assert {"9.incomplete", "6.corrupt"} <= set(os.listdir(d))
  assert not [n for n in os.listdir(d) if "orbax-checkpoint-tmp" in n]  # the writer cleans up
  # Later saves are not mistaken for older than the discarded steps.
  assert ckpt.save(5, _tree(5))
  ckpt.wait()
  assert ckpt.latest_step() == 5


def test_one_field_is_read_alone_and_cast_as_it_is_read(tmp_path, monkeypatch):
  """`restore_latest(part=)`: only the named field's arrays are deserialized (the optimizer's
  moments are left on disk), each in the dtype asked for; a corrupt newer step falls back to
  the older one as a whole-state restore does."""
  import orbax.checkpoint as ocp

  d = str(tmp_path)
  state = lambda s: {"params": _tree(s), "opt": {"mu": jnp.ones((64, 4)) * s}}
  ckpt = Checkpointer(d, keep=10)
  for s in (2, 4):
    ckpt.save(s, state(s))
  ckpt.close()
  _corrupt(os.path.join(d, "4"))
  read = []
  deserialize = ocp.type_handlers.ArrayHandler.deserialize

  def spy(self, infos, args=None):
    read.extend(i.name for i in infos)
    return deserialize(self, infos, args)

  monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", spy)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state(0))
  params = {
      "w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=one),
      "b": whole["params"]["b"],
  }
  reader = Checkpointer(d, keep=10, read_only=True)
  step, got = reader.restore_latest(whole, part=("params", params))
  reader.close()
  assert step == 2 and set(got) == {"w", "b"}
  assert got["w"].dtype == jnp.bfloat16 and got["b"].dtype == jnp.int32
  np.testing.assert_array_equal(got["w"], _tree(2)["w"].astype(jnp.bfloat16))
  np.testing.assert_array_equal(got["b"], _tree(2)["b"])
  assert read and not [n for n in read if "opt" in n], read


def test_mismatched_model_is_an_error_not_a_silent_fresh_start(tmp_path):
  _save_steps(str(tmp_path), [1, 2])
  ckpt = Checkpointer(str(tmp_path), keep=10)
  wrong = {
      "w": jax.ShapeDtypeStruct((4, 4), jnp.float32),
      "b": jax.ShapeDtypeStruct((4,), jnp.int32),
  }
  with pytest.raises(
      RuntimeError,
      match="no checkpoint in .* restores onto the current model"
      r"(.|\n)*holds \['w'\] \(8, 4\) float32 where the model needs \['w'\] "
      r"\(4, 4\) float32",
  ):
    ckpt.restore_latest(wrong)
  assert ckpt.steps() == [1, 2]  # nothing set aside


class _SigtermAt:
  """A source that delivers SIGTERM to this process while train batch `index` is being fetched."""

  def __init__(self, source, index):
    self.source, self.index = source, index

  def batch(self, split, index, batch, seq_len):
    if split == "train" and index == self.index:
      os.kill(os.getpid(), signal.SIGTERM)
    return self.source.batch(split, index, batch, seq_len)


def _config():
  c = tiny.get_config()
  c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every = 9, 2, 0, 3
  return c


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="SIGTERM handlers can only be installed from the main thread",
)
def test_interrupted_then_resumed_run_is_bit_identical(tmp_path):
  straight = str(tmp_path / "straight")
  reference = Trainer(_config(), straight)
  reference.train(progress=False)

  interrupted = str(tmp_path / "interrupted")
  first = Trainer(_config(), interrupted)
  first.source = _SigtermAt(first.source, index=4)
  summary = first.train(progress=False)
  assert summary["preempted"] and summary["step"] == 5
  assert first.checkpointer.steps() == [3, 5]
  # What a crash can leave behind: a newer step never committed, a newer step with broken files.
  steps_dir = os.path.join(interrupted, "checkpoints")
  os.makedirs(os.path.join(steps_dir, "7"))
  shutil.copytree(os.path.join(steps_dir, "5"), os.path.join(steps_dir, "6"))
  _corrupt(os.path.join(steps_dir, "6"))

  resumed = Trainer(_config(), interrupted)
  resumed.init()
  assert resumed.resumed_from == 5 and int(resumed.state.step) == 5
  resumed.train(progress=False)

  want, got = _losses(straight), _losses(interrupted)
  assert sorted(want) == list(range(1, 10)) and sorted(got) == list(range(1, 10))
  assert [got[s] for s in range(1, 10)] == [want[s] for s in range(1, 10)]  # bit-identical
  for a, b in zip(jax.tree.leaves(reference.state.params), jax.tree.leaves(resumed.state.params)):
    np.testing.assert_array_equal(a, b)
  assert resumed.checkpointer.steps() == [5, 6, 9]  # keep = 3
  assert {"6.corrupt", "7.incomplete"} <= set(os.listdir(steps_dir))


def test_a_step_whose_metadata_holds_a_null_commit_timestamp_is_set_aside(tmp_path):
  """What a first save killed mid-write leaves where orbax writes in place: the step's metadata
  with `commit_timestamp_nsecs: null` and no commit file. It is not a checkpoint: a writer sets it
  aside as incomplete and starts afresh, a reader lists no step."""
  from jaxpipe.runtime import checkpoint as checkpoint_lib

  step = tmp_path / "ckpt" / "2"
  (step / "default").mkdir(parents=True)
  metadata = {"init_timestamp_nsecs": 1796185884517380818, "commit_timestamp_nsecs": None}
  (step / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
  assert not checkpoint_lib.is_committed(str(step))
  reader = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=False, read_only=True)
  assert reader.steps() == [] and reader.latest_step() is None
  reader.close()
  assert step.is_dir()  # a reader moves nothing
  writer = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=False)
  assert writer.steps() == [] and writer.restore_latest({"x": jnp.zeros(2)}) is None
  writer.close()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2.incomplete"]
  # the same metadata with its timestamp set is a committed step
  metadata["commit_timestamp_nsecs"] = 1796185884662682506
  (step.parent / "3").mkdir()
  (step.parent / "3" / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
  assert checkpoint_lib.is_committed(str(step.parent / "3"))
