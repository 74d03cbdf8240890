"""Across processes, through `python -m jaxpipe.launch` (2 processes x 4 CPU devices): the pipeline
API and the training runner equal one process of 8 devices, with the pipeline or the data axis
across processes, through SIGTERM to the launcher or to one rank, kill -9 of a rank, and resumes
from 2 processes to 1 and back; the launcher ends a run whose rank failed."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from configs import tiny
from jaxpipe.pipeline import value_and_grad
from jaxpipe.runtime import multihost, process
from jaxpipe.runtime.checkpoint import is_committed
from jaxpipe.runtime.ranks import without_gloo_notices
from jaxpipe.training import mesh as mesh_lib
from jaxpipe.training.config import ConfigError, default_config
from jaxpipe.training.trainer import Trainer
from tests import helpers

pytestmark = pytest.mark.multiprocess

# (schedule, the axis that spans processes): pp with contiguous and with V-shaped stages, dp
CASES = (("1f1b", "pp"), ("zb-h1", "dp"), ("zb-v", "pp"))
# tiny.py on pp = 4 x dp = 2, every step logged, an evaluation and a checkpoint every 4 steps
OVERRIDES = {
    "model.n_layers": 4,
    "mesh.pp": 4,
    "pipeline.microbatches": 2,
    "train.steps": 40,
    "train.log_every": 1,
    "train.eval_every": 4,
    "train.eval_batches": 1,
    "checkpoint.every": 4,
}
FLAGS = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]


def pipeline_results() -> dict[str, np.ndarray]:
  """The loss and gradients of `jaxpipe.pipeline.value_and_grad` for each of CASES on all devices,
  read whole on this process (`multihost.to_host`)."""
  out = {}
  for schedule, across in CASES:
    cfg = default_config().mesh
    cfg.pp, cfg.order = 4, across
    mesh = mesh_lib.make_mesh(cfg)
    params, xs, ts = helpers.make_data(8 if schedule == "zb-v" else 4, 8)
    loss, grads = multihost.to_host(
        value_and_grad(
            helpers.stage_fn, params, xs, ts, helpers.loss_fn, schedule=schedule, sharding=mesh
        )
    )
    out.update({f"{schedule}/loss": loss, **{f"{schedule}/{k}": g for k, g in grads.items()}})
  return out


_SCRIPT = """
import sys
import numpy as np
from jaxpipe.runtime import process
process.initialize()
import jax
sys.path.insert(0, {root!r})
from tests.runtime.test_multiprocess import pipeline_results
np.savez({out!r} + str(jax.process_index()), **pipeline_results())
"""


def _launch(tmp_path, name, *command, grace=30, heartbeat=15, env=None):
  """Starts the launcher on `command` with its output in tmp_path/<name>.out. The heartbeat
  timeout is short for the tests that wait for it, long enough that a rank busy compiling on a
  loaded 2-core machine is not taken for dead."""
  cmd = [
      sys.executable,
      "-m",
      "jaxpipe.launch",
      "--processes",
      "2",
      "--devices_per_process",
      "4",
      "--heartbeat_timeout",
      str(heartbeat),
      "--grace",
      str(grace),
      "--rank_log_dir",
      str(tmp_path / name),
      "--",
      *command,
  ]
  with open(tmp_path / f"{name}.out", "w") as out:
    return subprocess.Popen(
        cmd,
        cwd=helpers.ROOT,
        env=env or helpers.env(tmp_path),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _output(tmp_path, name):
  return (tmp_path / f"{name}.out").read_text()


def _rank_pids(tmp_path, name):
  for _ in range(600):
    found = re.search(r"\(pids (\d+), (\d+)\)", _output(tmp_path, name))
    if found:
      return [int(p) for p in found.groups()]
    time.sleep(0.1)
  raise AssertionError(f"the launcher named no ranks: {_output(tmp_path, name)}")


def _eval_rows(workdir):
  """(step, eval_loss) of every metrics.jsonl line that has one."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.endswith("\n")]
  return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def _saved_by_both(out, signal_name):
  """The step each rank says it saved on `signal_name`; asserts both saved the same one."""
  steps = {
      int(rank): int(step)
      for rank, step in re.findall(rf"\[(\d)\] process \1: {signal_name}: saved step (\d+)", out)
  }
  assert sorted(steps) == [0, 1] and len(set(steps.values())) == 1, out[-3000:]
  return steps[0]


def test_pipeline_value_and_grad_across_processes_equals_one_process(tmp_path):
  script = tmp_path / "pipeline.py"
  script.write_text(_SCRIPT.format(root=helpers.ROOT, out=str(tmp_path / "rank")))
  launcher = _launch(tmp_path, "pipeline", sys.executable, str(script))
  want = pipeline_results()  # meanwhile, in this process on its 8 devices
  assert launcher.wait(timeout=600) == 0, _output(tmp_path, "pipeline")[-5000:]
  for rank in (0, 1):  # each process reads the whole of every gradient
    got = np.load(tmp_path / f"rank{rank}.npz")
    assert sorted(got.files) == sorted(want)
    for name, value in want.items():
      scale = np.max(np.abs(value))
      np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6 * scale, err_msg=name)


# Two minutes of four launches: -m slow. CI keeps the failed write on one process (both save
# modes), the hung rank, the pipeline across processes, and one process's signals (test_train).
@pytest.mark.slow
def test_training_across_processes_equals_one_process_through_faults(tmp_path):
  """2 processes (pp across) stopped by SIGTERM to the launcher; resumed in 1 process, SIGTERM;
  resumed in 2 (dp across), SIGTERM to rank 1 alone; resumed in 2, rank 1 killed with -9. Every
  step is logged once, with the loss an uninterrupted run on one process of 8 devices has."""
  workdir = tmp_path / "run"
  train = [
      sys.executable,
      "-m",
      "jaxpipe.train",
      "--config",
      "configs/tiny.py",
      "--workdir",
      str(workdir),
      *FLAGS,
  ]

  first = _launch(tmp_path, "first", *train)
  helpers.until_logged(first, workdir, 3, output=lambda: _output(tmp_path, "first"))
  first.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to both ranks
  assert first.wait(timeout=300) == 0, _output(tmp_path, "first")[-3000:]
  out = _output(tmp_path, "first")
  assert "in 2 processes x 4: across processes pp, within each dp (order pp,dp,ep,cp,tp)" in out
  assert "Traceback" not in out and "Gloo" not in out
  first_stop = _saved_by_both(out, "SIGTERM")

  one = subprocess.Popen(
      helpers.cli(workdir, *FLAGS),
      cwd=helpers.ROOT,
      env=helpers.env(tmp_path),
      text=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
  )
  helpers.until_logged(one, workdir, first_stop + 3)
  one.send_signal(signal.SIGTERM)
  stdout, stderr = one.communicate(timeout=300)
  assert one.returncode == 0, stderr[-3000:]
  assert f"resumed from step {first_stop} in " in stdout  # written by 2 processes, read by 1
  second_stop = int(stdout.split("SIGTERM: saved step ")[1].split()[0])

  third = _launch(tmp_path, "third", *train, "--config.mesh.order=dp")
  helpers.until_logged(third, workdir, second_stop + 3, output=lambda: _output(tmp_path, "third"))
  os.kill(_rank_pids(tmp_path, "third")[1], signal.SIGTERM)  # to one rank only
  assert third.wait(timeout=300) == 0, _output(tmp_path, "third")[-3000:]
  out = _output(tmp_path, "third")
  assert f"resumed from step {second_stop} in " in out  # written by 1 process, read by 2
  assert "across processes dp, within each pp" in out and "another layout: mesh.order" in out
  third_stop = _saved_by_both(out, "SIGTERM")

  fourth = _launch(tmp_path, "fourth", *train, "--config.mesh.order=dp")
  helpers.until_logged(
      fourth,
      workdir,
      third_stop // 4 * 4 + 5,  # just after a save has started
      output=lambda: _output(tmp_path, "fourth"),
  )
  os.kill(_rank_pids(tmp_path, "fourth")[1], signal.SIGKILL)
  killed = time.monotonic()
  status = fourth.wait(timeout=120)
  took = time.monotonic() - killed
  out = _output(tmp_path, "fourth")
  assert status != 0 and took < 60, (status, took, out[-3000:])
  assert f"resumed from step {third_stop} in " in out
  assert "error: rank 1 failed first (killed by SIGKILL); rank 0 " in out, out[-3000:]
  assert "rank 0 killed after the grace period" not in out  # it stopped by itself, saying why:
  assert (
      "[0] error: another process of this run has stopped or failed" in out  # a collective
      or "[0] F" in out
      and "stopped sending heartbeats" in out
  ), out[
      -3000:
  ]  # or JAX's
  steps = sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
  assert all(is_committed(str(workdir / "checkpoints" / str(n))) for n in steps), steps

  config = tiny.get_config()
  config.update_from_flattened_dict(OVERRIDES)
  with Trainer(config, str(workdir)) as resumed:  # the newest step restores, in 1 process
    resumed.init()
    assert resumed.resumed_from == steps[-1] >= third_stop
  rows, evals = helpers.loss_rows(workdir), _eval_rows(workdir)
  assert [s for s, _ in rows] == list(range(1, len(rows) + 1))  # each step once
  assert len(rows) >= third_stop // 4 * 4 + 5
  assert [s for s, _ in evals] == list(range(4, 4 * len(evals) + 1, 4))
  assert 4 * len(evals) >= third_stop // 4 * 4 and evals[-1][0] <= rows[-1][0]
  reference = Trainer(config)  # one process, 8 devices, uninterrupted, nothing written
  reference.init()
  want, want_evals = [], []
  for step in range(1, len(rows) + 1):
    want.append(float(reference.step()["loss"]))
    if step % 4 == 0:
      want_evals.append(reference.evaluate())
  np.testing.assert_allclose([loss for _, loss in rows], want, rtol=1e-6, atol=0)
  np.testing.assert_allclose([loss for _, loss in evals], want_evals, rtol=1e-6, atol=0)


_LEAVE = """
import os, sys, time
from jaxpipe.runtime import multihost, process
process.initialize()
import jax
together, late = sys.argv[1] == "1", float(sys.argv[2])
started = time.monotonic()
if jax.process_index() == 1:
  time.sleep(late)
  print("rank 1 says why", flush=True)
if together:
  arrived = multihost.leave_together(timeout_s=3.0)
  took = time.monotonic() - started
  print(f"rank {jax.process_index()} arrived={arrived} after {took:.1f} s", flush=True)
os._exit(1)
"""


def test_process_0_leaving_first_aborts_the_others_unless_they_leave_together(tmp_path):
  """Process 0's exit takes the coordination service with it: a process 1 that has not yet spoken
  (5 s late: on a loaded machine the abort can take over a second to land) is aborted silently.
  `leave_together` holds process 0 until the others arrive (process 1, 1 s late, says its line
  and exits cleanly), and ends its wait when one never does (process 1, 20 s late)."""
  script = tmp_path / "leave.py"
  script.write_text(_LEAVE)
  outs = {}
  for together, late in ((0, 5.0), (1, 1.0), (1, 20.0)):
    name = f"leave{together}_{late:.0f}"
    launcher = _launch(
        tmp_path, name, sys.executable, str(script), str(together), str(late), heartbeat=60
    )
    try:
      launcher.wait(timeout=120)
    finally:
      launcher.kill()
    outs[together, late] = _output(tmp_path, name)
  alone, together, abandoned = outs[0, 5.0], outs[1, 1.0], outs[1, 20.0]
  assert "rank 1 says why" not in alone and "SIGABRT" in alone, alone[-3000:]
  assert "[1] rank 1 says why" in together and "[1] rank 1 arrived=True" in together, together
  assert "SIGABRT" not in together and "Traceback" not in together, together[-3000:]
  waited = float(re.search(r"\[0\] rank 0 arrived=True after ([\d.]+) s", together).group(1))
  assert 0.9 < waited < 10, together[-3000:]
  assert "[0] rank 0 arrived=False after 3." in abandoned, abandoned[-3000:]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_write_that_fails_on_one_process_stops_every_process_at_once(tmp_path, async_save):
  """Rank 1's checkpoint write fails (a file-size limit on that process alone, as a full local disk
  fails it): both ranks stop with the same line, soon, not after orbax's 20-minute barrier
  timeout, and the checkpoint before stays the one a rerun resumes from."""
  workdir = tmp_path / "run"
  config = tiny.get_config()
  config.update_from_flattened_dict({**OVERRIDES, "checkpoint.async_save": async_save})
  helpers.checkpoint_at(config, workdir, 4)
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # no cache writes
  capped = ["bash", "-c", 'if [ "$JAX_PROCESS_ID" = 1 ]; then ulimit -f 20; fi; exec "$@"', "bash"]
  started = time.monotonic()
  launcher = _launch(
      tmp_path,
      "capped",
      *capped,
      *helpers.cli(workdir, *FLAGS),
      f"--config.checkpoint.async_save={async_save}",
      env=env,
  )
  try:
    status = launcher.wait(timeout=240)
  finally:  # hung (orbax's barrier waits 20 minutes): end the ranks too
    if launcher.poll() is None:
      for pid in _rank_pids(tmp_path, "capped"):
        os.kill(pid, signal.SIGKILL)
      launcher.kill()
  took = time.monotonic() - started
  out = _output(tmp_path, "capped")
  assert status == 1 and took < 150, (status, took, out[-3000:])
  lines = {
      rank: re.sub(r"[\d,]+ are free", "N are free", line)
      for rank, line in re.findall(r"\[(\d)\] (error: .*)", out)
  }
  assert sorted(lines) == ["0", "1"] and lines["0"] == lines["1"], out[-3000:]
  assert lines["0"].startswith(
      f"error: saving step 8 in {workdir}/checkpoints failed on process 1: "
  )
  assert (
      "File too large" in lines["0"] and "The last good checkpoint, step 4, is kept" in lines["0"]
  )
  assert "Traceback" not in out
  assert 8 <= helpers.last_logged(workdir) < 12  # noticed before the next save was due
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]  # the partial write is gone
  with Trainer(config, str(workdir)) as resumed:
    resumed.init()
    assert resumed.resumed_from == 4


def test_a_rank_that_hangs_is_found_by_the_heartbeat(tmp_path):
  """Rank 1 frozen (SIGSTOP) in the middle of collectives: its connections stay open, so only the
  heartbeat (5 s here) finds it; rank 0 stops naming it and the launcher ends the run."""
  script = tmp_path / "hang.py"
  script.write_text(
      "from jaxpipe.runtime import process\nprocess.initialize()\n"
      "from jaxpipe.runtime import multihost\nprint('ready', flush=True)\n"
      "while True:\n  multihost.any_process(False)\n"
  )
  launcher = _launch(tmp_path, "hang", sys.executable, str(script), grace=1, heartbeat=5)
  pids = _rank_pids(tmp_path, "hang")
  while _output(tmp_path, "hang").count("] ready") < 2:
    assert launcher.poll() is None, _output(tmp_path, "hang")
    time.sleep(0.1)
  os.kill(pids[1], signal.SIGSTOP)
  frozen = time.monotonic()
  status = launcher.wait(timeout=120)
  took = time.monotonic() - frozen
  out = _output(tmp_path, "hang")
  assert status == 128 + signal.SIGABRT and took < 60, (status, took, out[-3000:])
  assert "error: rank 0 failed first (killed by SIGABRT); rank 1 killed after the grace " in out
  summary = out.split("error: rank 0 failed first")[1]
  assert "The following tasks are unhealthy (stopped sending heartbeats):\n  1\n" in summary


def test_launcher_ends_the_other_ranks_when_one_fails(tmp_path):
  """Rank 1 fails at once while rank 0 would run on: rank 0's process group is killed after the
  grace period and the launcher exits with rank 1's status, naming it, with its last lines."""
  rank_code = (
      "import os, sys, time; rank = int(os.environ['JAX_PROCESS_ID']); "
      "print('rank', rank, 'of', os.environ['JAX_NUM_PROCESSES'], "
      "os.environ['JAX_COORDINATOR_ADDRESS'].startswith('127.0.0.1:')); "
      "time.sleep(0 if rank else 300); sys.exit(3)"
  )
  started = time.monotonic()
  launcher = _launch(tmp_path, "fail", sys.executable, "-c", rank_code, grace=1)
  assert launcher.wait(timeout=60) == 3
  assert time.monotonic() - started < 30
  out = _output(tmp_path, "fail")
  assert "[0] rank 0 of 2 True" in out and "[1] rank 1 of 2 True" in out
  assert (
      "error: rank 1 failed first (status 3); rank 0 killed after the grace period. Its last "
      f"lines ({tmp_path / 'fail' / 'rank1.log'}):\n  rank 1 of 2 True"
  ) in out
  assert (tmp_path / "fail" / "rank0.log").read_text() == "rank 0 of 2 True\n"


def test_gloo_notices_stay_out_of_the_console():
  """gloo's threads write their notices in pieces, inside one another (as seen in a rank's log)."""
  raw = (
      b"loss 3.5\n[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected "
      b"peer ranks is : 1\n[Gloo] Rank [Gloo] Rank 0 is connected to 31 is connected to 3 peer "
      b"ranks.  peer ranks. Expected number of connected peer ranks is : 3\nExpected number of "
      b"connected peer ranks is : 3\n\rtrain:   5%| 2/40\n12 steps\n"
  )
  assert without_gloo_notices(raw) == b"loss 3.5\n\rtrain:   5%| 2/40\n12 steps\n"
  assert without_gloo_notices(b"1\n2 3\n") == b"1\n2 3\n"  # numbers of its own are kept
  bar = b"\rtrain:  20%| 8/40 [00:00<?, ?it/s]"  # a notice right after a bar, not at a line start
  notice = (
      b"[Gloo] Rank 1 is connected to 1 peer ranks. "
      b"Expected number of connected peer ranks is : 1\n"
  )
  assert without_gloo_notices(bar + notice + notice + b"\rtrain:  22%|") == bar + b"\rtrain:  22%|"


def test_bad_multiprocess_settings_are_named(monkeypatch):
  for name in (process.COORDINATOR_ENV, process.PROCESSES_ENV, process.PROCESS_ID_ENV):
    monkeypatch.delenv(name, raising=False)
  assert process.initialize() is False  # nothing describes a multi-process run
  with pytest.raises(ValueError, match="needs --coordinator_address, --process_id as well"):
    process.initialize(num_processes=2)
  with pytest.raises(ValueError, match=r"--process_id=2 must be in 0..1 \(--num_processes=2\)"):
    process.initialize("127.0.0.1:1234", 2, 2)
  monkeypatch.setenv(process.PROCESSES_ENV, "two")
  with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='two' must be an integer"):
    process.initialize()
  cfg = ml_collections.ConfigDict(default_config().mesh.to_dict())
  cfg.order = "dp,pp,dp"
  with pytest.raises(ConfigError, match="mesh.order='dp,pp,dp' names an axis twice"):
    mesh_lib.make_mesh(cfg)
  cfg.order = "dp"
  assert mesh_lib.make_mesh(cfg).shape["dp"] == jax.device_count()
