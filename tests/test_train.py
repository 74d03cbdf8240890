"""The training runner under faults: kill -9, SIGINT, SIGTERM, a second run in the workdir, a full
disk, a changed config and bad inputs lose nothing, repeat nothing and end with one line."""

import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from jaxpipe import schedule
from jaxpipe.runtime import cli, files, process
from jaxpipe.runtime.checkpoint import Checkpointer, CheckpointMismatchError, CheckpointSaveError
from jaxpipe.runtime.metrics import drop_rows_after
from jaxpipe.runtime.preemption import StopRequest
from jaxpipe.training.config import ConfigError
from jaxpipe.training.trainer import NonFiniteLossError, Trainer
from jaxpipe.training.workdir import Workdir, WorkdirBusy, WorkdirError, field_kind
from tests import helpers

ROOT = helpers.ROOT
main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers are installed from the main thread",
)


def _config(steps, every=5, **train):
  c = tiny.get_config()
  c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every = steps, 1, 0, every
  for k, v in train.items():
    c.train[k] = v
  return c


def _flags(steps, every=5):
  """The command-line overrides that make tiny.py into `_config(steps, every)`."""
  return [
      f"--config.train.steps={steps}",
      "--config.train.log_every=1",
      "--config.train.eval_every=0",
      f"--config.checkpoint.every={every}",
  ]


def _tensorboard_losses(logdir):
  """The `loss` scalars TensorBoard shows: event files in order, each SessionLog.START at step p
  purging the earlier events at steps >= p (TensorBoard's restart rule)."""
  from tensorboardX.proto import event_pb2

  shown = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data, i = open(path, "rb").read(), 0
    while i + 12 <= len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
      (n,) = struct.unpack("<Q", data[i : i + 8])
      if i + 16 + n > len(data):
        break  # a record cut short by kill -9
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 16 + n
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        shown = {k: v for k, v in shown.items() if k[0] < event.step}
      for value in event.summary.value:
        if value.tag == "loss":
          key = (event.step, len([k for k in shown if k[0] == event.step]))
          shown[key] = value.simple_value
  return sorted(shown.items())


def _messages(stderr):
  """stderr's lines without the progress bar's."""
  return [m for m in re.split(r"[\r\n]", stderr) if m.strip() and not m.startswith("train:")]


def _saved(out, name):
  return int(out.split(f"{name}: saved step ")[1].split()[0])


@main_thread_only
def test_kill_sigint_sigterm_and_reruns_equal_an_uninterrupted_run(tmp_path):
  """A run killed with -9 (while a second run finds the workdir locked), then stopped by SIGINT
  and by SIGTERM, each time resumed by the same command: every step is logged once (jsonl and
  TensorBoard) with the uninterrupted run's loss, and the final state is that run's, bit for bit."""
  steps, workdir, env = 60, tmp_path / "run", helpers.env(tmp_path)
  cmd = helpers.cli(workdir, *_flags(steps))
  start = lambda: subprocess.Popen(
      cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
  )

  first = start()
  helpers.until_logged(first, workdir, 12)
  first.send_signal(signal.SIGSTOP)  # alive and holding the workdir, frozen mid-run
  killed_at = helpers.last_logged(workdir)
  with pytest.raises(WorkdirBusy, match=f"{workdir} is in use by process {first.pid} on "):
    Workdir(str(workdir)).lock()
  first.kill()
  first.communicate()

  second = start()
  helpers.until_logged(second, workdir, killed_at + 8)  # past anything the killed run logged
  second.send_signal(signal.SIGINT)
  out, err = second.communicate(timeout=300)
  assert second.returncode == 0, err[-3000:]
  assert f"took over the lock of {workdir} from process {first.pid} on " in err
  assert "resumed from step " in out and "Traceback" not in err
  assert "SIGINT: finishing this step and saving" in err
  interrupted = _saved(out, "SIGINT")
  assert interrupted >= killed_at + 8

  third = start()
  helpers.until_logged(third, workdir, interrupted + 8)
  third.send_signal(signal.SIGTERM)
  out, err = third.communicate(timeout=300)
  assert third.returncode == 0, err[-3000:]
  assert f"resumed from step {interrupted} in " in out and "took over" not in err
  terminated = _saved(out, "SIGTERM")

  last = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
  assert last.returncode == 0, last.stderr[-3000:]
  assert f"resumed from step {terminated} in " in last.stdout
  # train.eval_every=0: no evaluation at all, the last step's included
  assert "loss: first " in last.stdout and "eval loss" not in last.stdout
  assert "eval_loss" not in (workdir / "metrics.jsonl").read_text()

  reference = Trainer(_config(steps))  # uninterrupted, nothing written
  reference.init()
  want = [(s, float(reference.step()["loss"])) for s in range(1, steps + 1)]
  assert helpers.loss_rows(workdir) == want  # each step once, bit-identical losses
  shown = _tensorboard_losses(workdir / "tensorboard")
  assert [step for (step, _), _ in shown] == list(range(1, steps + 1))
  assert [v for _, v in shown] == [np.float32(loss) for _, loss in want]
  with Trainer(_config(steps), str(workdir)) as resumed:
    state = resumed.init()
    assert resumed.resumed_from == steps
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(reference.state))
    ):
      np.testing.assert_array_equal(a, b)


class _SigintAt:
  """A source that sends this process SIGINT `times` times while train batch `index` is fetched."""

  def __init__(self, source, index, times):
    self.source, self.index, self.times = source, index, times

  def batch(self, split, index, batch, seq_len):
    if split == "train" and index == self.index:
      for _ in range(self.times):
        os.kill(os.getpid(), signal.SIGINT)
    return self.source.batch(split, index, batch, seq_len)


@main_thread_only
def test_first_sigint_saves_and_a_second_aborts_at_once(tmp_path):
  before = signal.getsignal(signal.SIGINT)
  with Trainer(_config(10, every=2), str(tmp_path)) as trainer:
    source = trainer.source
    trainer.source = _SigintAt(source, index=4, times=1)  # while step 5's batch is fetched
    summary = trainer.train(progress=False)
    assert summary["preempted"] and summary["stop_signal"] == "SIGINT" and summary["step"] == 5
    assert trainer.checkpointer.steps() == [2, 4, 5]
    assert signal.getsignal(signal.SIGINT) is before
    trainer.source = _SigintAt(source, index=6, times=2)  # step 7's
    with pytest.raises(KeyboardInterrupt):
      trainer.train(progress=False)
    assert trainer.checkpointer.steps() == [4, 5, 6]  # keep = 3; nothing saved after the 2nd Ctrl-C
    assert [s for s, _ in helpers.loss_rows(tmp_path)] == [1, 2, 3, 4, 5, 6]
  assert signal.getsignal(signal.SIGINT) is before


@main_thread_only
def test_a_second_ctrl_c_that_python_swallowed_still_aborts_at_the_next_step():
  """A KeyboardInterrupt raised inside a gc callback is only reported: the loop's next look at
  the request raises it again instead of saving."""
  with StopRequest() as stop:
    handler = signal.getsignal(signal.SIGINT)  # called directly: a real signal could land in gc
    handler(signal.SIGINT, None)
    assert stop.agreed() == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      handler(signal.SIGINT, None)  # the interrupt Python would have swallowed
    with pytest.raises(KeyboardInterrupt, match="SIGINT while stopping after SIGINT"):
      stop.agreed()


def test_changed_config_is_refused_and_the_choices_are_recorded(tmp_path):
  workdir = str(tmp_path)
  helpers.checkpoint_at(_config(4, every=2), workdir, 4)
  with Trainer(_config(4, every=2), workdir) as trainer:  # the same config: a finished run
    summary = trainer.train(progress=False)
    assert (summary["start"], summary["step"], summary["first_loss"]) == (4, 4, None)
  assert not os.path.exists(
      os.path.join(workdir, "metrics.jsonl")
  )  # nothing trained, nothing logged
  stored = open(os.path.join(workdir, "config.json")).read()

  # The README's override example on a finished run's workdir.
  r = subprocess.run(
      helpers.cli(workdir, *_flags(8, every=2), "--config.optimizer.lr=2e-3"),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 2 and len(_messages(r.stderr)) == 1, r.stderr
  assert r.stderr.startswith("error: "), r.stderr
  for needle in (
      f"{workdir} holds a run with another config (checkpoint at step 4)",
      "optimizer.lr 0.01 -> 0.002",
      "train.steps 4 -> 8 (the learning-rate schedule",
      "another --workdir",
      "--resume_changed",
      f"--restart to start over here (the old run moves to {workdir}/previous-1)",
  ):
    assert needle in r.stderr, needle
  assert open(os.path.join(workdir, "config.json")).read() == stored
  assert not os.path.exists(os.path.join(workdir, "config_history.jsonl"))

  changed = _config(8, every=2)
  changed.optimizer.lr = 2e-3
  with pytest.raises(WorkdirError, match="optimizer.lr 0.01 -> 0.002"):
    Trainer(changed, workdir)
  cadence = _config(4, every=3, log_every=2, eval_every=2)  # logging/eval/checkpoint cadence
  with Trainer(cadence, workdir) as trainer:
    assert trainer.notices == []
  layout = _config(4, every=3)
  layout.pipeline.microbatches = 2
  with Trainer(layout, workdir) as trainer:
    assert trainer.notices == [
        "resuming (checkpoint at step 4) with another layout: "
        "pipeline.microbatches 1 -> 2 (the same model and optimizer; "
        "losses equal the unchanged run's up to float rounding)"
    ]
  with Trainer(changed, workdir, existing_run="resume_changed") as trainer:
    assert "under a changed config" in trainer.notices[0]
    trainer.init()
    assert trainer.resumed_from == 4
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["optimizer"]["lr"] == 2e-3
  short = _config(3, every=2)
  with pytest.raises(WorkdirError, match=r"train.steps=3 is below the checkpoint at step 4"):
    Trainer(short, workdir, existing_run="resume_changed")
  with Trainer(short, workdir, existing_run="restart") as trainer:
    trainer.init()
    assert trainer.resumed_from is None and not os.listdir(os.path.join(workdir, "checkpoints"))
  assert sorted(os.listdir(os.path.join(workdir, "previous-1"))) == ["checkpoints", "config.json"]
  assert os.listdir(os.path.join(workdir, "previous-1", "checkpoints")) == ["4"]
  with open(os.path.join(workdir, "config_history.jsonl")) as f:
    history = [json.loads(line) for line in f]
  assert [(h["choice"], h["step"]) for h in history] == [
      ("resume", 4),
      ("resume", 4),
      ("resume_changed", 4),
      ("restart", 4),
  ]
  assert history[2]["changes"]["optimizer.lr"] == [0.01, 0.002]
  assert history[2]["changes"]["train.steps"] == [4, 8]
  assert history[3]["moved_to"] == os.path.join(workdir, "previous-1")


def test_field_kinds():
  c = tiny.get_config()
  assert [
      field_kind(k, c)
      for k in (
          "checkpoint.every",
          "mesh.dp",
          "pipeline.schedule",
          "model.remat",
          "optimizer.shard",
          "model.sequence_parallel",
          "model.unroll_layers",
          "train.steps",
          "optimizer.lr",
          "data.seed",
          "model.d_model",
      )
  ] == ["cadence"] + ["layout"] * 6 + ["run"] * 4
  assert field_kind("train.pool_host_memory", c) == "cadence"  # changes on resume freely
  from configs import moe_quickstart

  moe = moe_quickstart.get_config()  # capacity dispatch: the mesh decides which tokens overflow
  assert field_kind("mesh.ep", moe) == field_kind("pipeline.microbatches", moe) == "run"
  assert field_kind("model.sequence_parallel", moe) == "run"  # splits the routed tokens
  assert field_kind("pipeline.schedule", moe) == "layout"


def test_a_workdir_with_nothing_trained_takes_a_changed_config(tmp_path):
  """No checkpoint, or only an import's step 0: nothing to splice, so the change is taken."""
  workdir = Workdir(str(tmp_path))
  assert workdir.check_config(_config(4)) == []
  changed = _config(8)
  changed.optimizer.lr = 0.5
  notices = workdir.check_config(changed)
  assert len(notices) == 1 and notices[0].startswith("nothing trained yet (no checkpoint yet)")
  assert "optimizer.lr" in notices[0] and "train.steps 4 -> 8" in notices[0]
  step0 = tmp_path / "checkpoints" / "0"
  step0.mkdir(parents=True)
  (step0 / "commit_success.txt").write_text("")
  assert workdir.latest_step() == 0
  notices = workdir.check_config(_config(4))
  assert notices[0].startswith("nothing trained yet (checkpoint at step 0)")
  history = [json.loads(line) for line in open(tmp_path / "config_history.jsonl")]
  assert [h["step"] for h in history] == [None, 0]
  (tmp_path / "checkpoints" / "3").mkdir()
  (tmp_path / "checkpoints" / "3" / "commit_success.txt").write_text("")
  with pytest.raises(WorkdirError, match="holds a run with another config"):
    workdir.check_config(changed)


def test_a_run_from_before_data_tokenizer_resumes_with_the_tokenizer_it_read(tmp_path):
  """config.json written before data.tokenizer existed: the run read its hf/ tokenizer if it had
  one, so 'hf' there (bytes elsewhere) is no change, and the other value is one."""
  for has_hf, same, other in ((True, "hf", "bytes"), (False, "bytes", "hf")):
    path = tmp_path / str(has_hf)
    path.mkdir()
    if has_hf:
      (path / "hf").mkdir()
      (path / "hf" / "tokenizer.json").write_text("{}")
    stored = json.loads(_config(4).to_json_best_effort())
    del stored["data"]["tokenizer"]
    (path / "config.json").write_text(json.dumps(stored))
    (path / "checkpoints" / "3").mkdir(parents=True)  # something trained: a change is refused
    (path / "checkpoints" / "3" / "commit_success.txt").write_text("")
    config = _config(4)
    config.data.tokenizer = same
    assert Workdir(str(path)).check_config(config, write=False) == []
    config.data.tokenizer = other
    with pytest.raises(WorkdirError, match=f'data.tokenizer "{same}" -> "{other}"'):
      Workdir(str(path)).check_config(config, write=False)


def test_an_unknown_data_tokenizer_is_one_line(tmp_path):
  config = _config(4)
  config.data.tokenizer = "sentencepiece"
  with pytest.raises(ConfigError, match="data.tokenizer='sentencepiece' is unknown; use 'bytes'"):
    Trainer(config, str(tmp_path))


def test_model_changed_under_a_checkpoint_names_the_same_array(tmp_path):
  helpers.checkpoint_at(_config(2, every=2), tmp_path, 2)
  wider = _config(2, every=2)
  wider.model.d_model = 48
  with Trainer(wider, str(tmp_path), existing_run="resume_changed") as trainer:
    with pytest.raises(CheckpointMismatchError) as e:
      trainer.init()
  assert (
      "the checkpoint holds .params['embed'] (64, 32) float32 where the model needs "
      ".params['embed'] (64, 48) float32 (of 36 arrays: 33 differ in shape or dtype)"
  ) in str(e.value)


def test_full_disk_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path):
  """A write that fails (here: past a file-size limit, as a full disk fails it) stops the run
  as soon as the background save ends, well before the next save is due, with one line naming
  the directory and the bytes; the checkpoint before it stays and the partial write goes."""
  workdir = tmp_path / "run"
  helpers.checkpoint_at(_config(60, every=20), workdir, 20)
  # bash's `ulimit -f` (KiB) caps every file the run writes; Python ignores SIGXFSZ, so a write
  # past it fails with EFBIG. The checkpoint's data files take about 250 KiB.
  r = subprocess.run(
      [
          "bash",
          "-c",
          'ulimit -f 20 && exec "$@"',
          "bash",
          *helpers.cli(workdir, *_flags(60, every=20)),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env={
          k: v
          for k, v in os.environ.items()  # no cache writes past the limit
          if k != "JAX_COMPILATION_CACHE_DIR"
      },
  )
  assert r.returncode == 1, r.stderr[-3000:]
  (line,) = _messages(r.stderr)  # nothing from orbax, asyncio or tensorstore
  assert line.startswith(f"error: saving step 40 in {workdir}/checkpoints failed: "), line
  assert "File too large" in line and "The last good checkpoint, step 20, is kept" in line
  assert 40 <= helpers.last_logged(workdir) < 60  # noticed before the next save was due
  assert sorted(os.listdir(workdir / "checkpoints")) == ["20"]
  assert Checkpointer(str(workdir / "checkpoints"), keep=3).latest_step() == 20


def test_no_room_for_a_checkpoint_stops_before_the_first_step(tmp_path, monkeypatch):
  import jaxpipe.runtime.checkpoint

  usage = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(
      jaxpipe.runtime.checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=1000)
  )
  with Trainer(_config(4), str(tmp_path)) as trainer:
    with pytest.raises(CheckpointSaveError) as e:
      trainer.train(progress=False)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state))
    assert int(trainer.state.step) == 0
  assert str(e.value).startswith(
      f"no checkpoint fits in {tmp_path}/checkpoints: 1,000 bytes free "
      f"there, fewer than the {nbytes:,} bytes a checkpoint takes"
  )
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_non_finite_gradient_is_named_as_such():
  trainer = Trainer(_config(3))
  trainer.loss_and_grads = lambda params, batch: (
      jnp.float32(4.1589),
      jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params),
      {"tokens": jnp.sum(batch["mask"])},
  )
  with pytest.raises(
      NonFiniteLossError,
      match=r"^non-finite gradient norm nan \(the loss, 4.1589, "
      r"is finite\) at step 1, found when checking steps 1..1",
  ):
    trainer.train(progress=False)


def test_metrics_past_the_restored_step_are_dropped(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 8)] + [{"step": 5, "eval_loss": 0.5}]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write('{"step": 8, "lo')  # cut short by kill -9
  assert drop_rows_after(path, 5) == 3  # steps 6, 7 and the cut line
  assert [json.loads(line) for line in open(path)] == [r for r in rows if r["step"] <= 5]
  assert drop_rows_after(path, 5) == 0


def test_a_file_write_that_fails_leaves_the_old_file_whole(tmp_path):
  """metrics.jsonl's rewrite, config.json, cost files and results go through write_atomically."""
  import resource

  path = tmp_path / "config.json"
  files.write_json(path, {"old": 1})
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))  # a full disk after 100 bytes
  try:
    with pytest.raises(OSError, match="File too large"):
      files.write_json(path, {"new": "x" * 1000})
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  assert json.loads(path.read_text()) == {"old": 1}
  assert os.listdir(tmp_path) == ["config.json"]  # no .tmp left behind


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (
            ["--gin_param", "model.dmodel = 64"],
            {},
            "error: gin binding model.dmodel: no such field; did you mean model.d_model?",
        ),
        (["--gin_file", "missing.gin"], {}, "error: --gin_file missing.gin: no such file"),
        (
            ["--config.model.dtype=float16"],
            {},
            "error: model.dtype='float16' does not run on cpu: XLA:CPU has no float16 matmul",
        ),
        ([], {"config": "configs/missing.py"}, "error: --config configs/missing.py: no such file"),
        (
            [],
            {"JAXPIPE_HOST_DEVICES": "abc"},
            "error: JAXPIPE_HOST_DEVICES='abc' must be a positive",
        ),
        (
            ["--num_processes=2", "--process_id=0"],
            {},
            "error: a multi-process run needs --coordinator_address as well",
        ),
    ],
)
def test_cli_bad_inputs_end_with_one_error_line(args, env, needle):
  env = dict(env)
  config = env.pop("config", "configs/tiny.py")
  run_env = {**os.environ, **env}
  if "JAXPIPE_HOST_DEVICES" in env:  # the test's own device-count flag would win over it
    run_env.pop("XLA_FLAGS")
  r = subprocess.run(
      [sys.executable, "-m", "jaxpipe.train", "--config", config, *args],
      cwd=ROOT,
      env=run_env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 2, r.stderr[-3000:]
  assert _messages(r.stderr) == [r.stderr.strip()] and r.stderr.startswith(needle), r.stderr
  assert r.stdout == ""


def test_debug_shows_the_traceback():
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "jaxpipe.train",
          "--config",
          "configs/tiny.py",
          "--gin_param",
          "model.dmodel = 64",
          "--debug",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError: gin binding" in r.stderr


def test_bad_inputs_found_in_process(tmp_path, monkeypatch):
  for value in ("0", "-3", "abc"):
    monkeypatch.setenv("JAXPIPE_HOST_DEVICES", value)
    with pytest.raises(ValueError, match=f"JAXPIPE_HOST_DEVICES={value!r} must be a positive"):
      process.host_device_count()
  unwritable = "/sys/jaxpipe-test" if os.geteuid() == 0 else str(tmp_path / "ro" / "run")
  if os.geteuid() != 0:  # root writes anywhere but in /sys
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o555)
  with pytest.raises(WorkdirError, match=f"--workdir {unwritable} cannot be created: "):
    Workdir(unwritable)
  (tmp_path / "file").write_text("")
  with pytest.raises(WorkdirError, match=f"--workdir {tmp_path}/file is a file, not a directory"):
    Trainer(tiny.get_config(), str(tmp_path / "file"))
  from configs import moe_quickstart

  for field, value, needle in [
      (
          "num_experts",
          6,
          "model.moe: num_experts=6 is not divisible by the expert axis size ep=4",
      ),
      ("top_k", 9, "model.moe: top_k=9 exceeds num_experts=8"),
  ]:
    c = moe_quickstart.get_config()
    c.model.moe[field] = value
    with pytest.raises(ConfigError, match=needle):
      Trainer(c)


@pytest.mark.parametrize("pooled", [True, False])
def test_the_trainer_pools_host_memory_on_cpu_as_configured(tmp_path, monkeypatch, pooled):
  """train.pool_host_memory: `python -m jaxpipe.train` keeps freed host memory in the heap on
  CPU devices (process.pool_host_memory), and leaves glibc's defaults when it is False."""
  from jaxpipe import train

  calls = []
  monkeypatch.setattr(process, "pool_host_memory", lambda: calls.append(1) or True)
  c = tiny.get_config()
  c.train.steps, c.train.pool_host_memory = 1, pooled
  monkeypatch.setattr(train, "_load_config", lambda: c)
  train.FLAGS.unparse_flags()
  train.FLAGS(["train", f"--workdir={tmp_path}"])
  try:
    train._train(["train"])
  finally:
    train.FLAGS.unparse_flags()
  assert calls == ([1] if pooled else [])


def test_schedule_cli_names_the_file_it_wrote(tmp_path, capsys):
  for fmt in ("png", "perfetto"):
    out = str(tmp_path / f"s.{fmt}")
    assert (
        cli.call(
            schedule.main,
            schedule.FLAGS,
            ["1f1b", "--pp", "2", "--microbatches", "4", "--format", fmt, "--out", out],
        )
        == 0
    )
    assert capsys.readouterr().out == f"wrote {fmt} to {out}\n" and os.path.getsize(out) > 0


def test_the_wheel_holds_the_library_not_the_runners(tmp_path):
  """A wheel built from the tree holds jaxpipe and its kernels (the CPU kernel's source
  included); experiments/ and configs/ run from the repository's root and are not installed, so
  no other `import experiments` or `import configs` finds them."""
  pytest.importorskip("setuptools")  # the build backend, built without isolation (no download)
  src = tmp_path / "src"
  shutil.copytree(
      ROOT,
      src,
      ignore=shutil.ignore_patterns(
          ".git", "tests", "notebooks", "docs", "build", "*.egg-info", "__pycache__"
      ),
  )
  subprocess.run(
      [
          sys.executable,
          "-m",
          "pip",
          "wheel",
          "--no-deps",
          "--no-build-isolation",
          "-q",
          "-w",
          str(tmp_path / "dist"),
          str(src),
      ],
      check=True,
      capture_output=True,
      timeout=300,
  )
  (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {
      "jaxpipe/__init__.py",
      "jaxpipe/planning/costs.py",
      "kernels_cpu/paged_attention.cc",
      "kernels_cpu/matmul.cc",
      "kernels_pallas/__init__.py",
  } <= names, sorted(names)[:20]
  tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert tops == {"jaxpipe", "kernels_cpu", "kernels_pallas"}, tops
