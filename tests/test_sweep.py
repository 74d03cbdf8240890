"""Measured stage costs, pipeline.schedule=auto in the Trainer, planned vs measured ticks, sweeps."""
import csv
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from configs import tiny
from experiments import sweep
from jaxpipe import config as config_lib
from jaxpipe import measure, tick_trace
from jaxpipe.models import transformer
from jaxpipe.pipeline import costs as costs_lib
from jaxpipe.pipeline.api import lowered_for
from jaxpipe.pipeline.lm import lm_schedule
from jaxpipe.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICROBATCHES = (1, 4)  # the auto grid: 1F1B on pp = 2 (tiny: 2 layers, 2 stages)


def tiny_pp2(**pipeline):
  c = tiny.get_config()
  c.mesh.pp = 2
  c.pipeline.update(pipeline)
  return c


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  """Costs of tiny's stage on pp = 2 x dp = 4 at 1 and 4 micro-batches, measured here."""
  data = measure.measure(tiny_pp2(), [(m, 2) for m in MICROBATCHES], repeats=3)
  path = str(tmp_path_factory.mktemp("costs") / "costs.json")
  costs_lib.dump(data, path)
  return path


def test_measured_cost_file_is_complete_and_its_bytes_exact(cost_file):
  costs = costs_lib.load(cost_file)  # every part present, non-negative
  cfg = config_lib.model_config(tiny_pp2())
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  nbytes = lambda tree: sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))
  layers = nbytes(params["layers"])
  shared = nbytes({k: v for k, v in params.items() if k != "layers"})
  for m in MICROBATCHES:
    e = costs.entry(m, 2)
    b = 16 // (4 * m)  # batch 16 over dp = 4 data ranks and m micro-batches
    assert e.bytes["activation"] == b * 16 * 32 * 4  # [b, seq 16, d_model 32] float32
    assert e.bytes["wg"] == e.bytes["activation"]  # one layer per stage: its output cotangent
    assert e.bytes["residual"] > e.bytes["activation"] and e.bytes["work"] > 0
  # AdamW keeps two moments beside each parameter; the layer stack is split over pp = 2
  assert costs.step["layer_state_bytes"] == 3 * layers // 2
  assert costs.step["layer_grad_bytes"] == layers // 2
  assert costs.step["shared_grad_bytes"] == shared
  assert 3 * shared <= costs.step["shared_state_bytes"] <= 3 * shared + 64  # + step counts
  assert costs.setup["mesh"]["pp"] == 2 and "load_average" in costs.setup


@pytest.fixture(scope="module")
def auto_trainer(cost_file, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("auto"))
  config = tiny_pp2(schedule="auto", costs=cost_file, auto_schedules=("1f1b",),
                    auto_microbatches=MICROBATCHES)
  return Trainer(config, workdir), config, workdir


def test_auto_trains_the_best_ranked_candidate_and_keeps_its_choice(auto_trainer, cost_file):
  trainer, config, workdir = auto_trainer
  assert config.pipeline.schedule == "auto"  # the caller's config is left alone
  costs = costs_lib.load(cost_file)
  best = min(MICROBATCHES, key=lambda m: costs.predict(
      lowered_for(lm_schedule(tiny_pp2(microbatches=m).pipeline, 2))).step_s)
  assert (trainer.config.pipeline.schedule, trainer.config.pipeline.microbatches) == ("1f1b",
                                                                                      best)
  assert f"auto chose 1f1b m={best}" in trainer.auto_report
  with open(os.path.join(workdir, "auto.json")) as f:
    assert json.load(f)["choice"]["microbatches"] == best
  again = Trainer(config.copy_and_resolve_references(), workdir)  # a resumed run: same choice
  assert again.config.pipeline.microbatches == best and again.auto_report == trainer.auto_report


def test_auto_respects_the_memory_limit_and_errors_when_nothing_fits(cost_file):
  costs = costs_lib.load(cost_file)
  need = {m: costs.predict(lowered_for(lm_schedule(tiny_pp2(microbatches=m).pipeline,
                                                    2))).memory_bytes for m in MICROBATCHES}
  small, big = sorted(MICROBATCHES, key=need.get)
  assert need[small] < need[big]  # one micro-batch holds 4x the activations of a quarter
  limit = (need[small] + need[big]) / 2 / 2**30
  trainer = Trainer(tiny_pp2(schedule="auto", costs=cost_file, auto_schedules=("1f1b",),
                             auto_microbatches=MICROBATCHES, memory_limit_gb=limit))
  assert trainer.config.pipeline.microbatches == small
  assert f"1f1b m={big}" in trainer.auto_report and "over the memory limit" in trainer.auto_report
  with pytest.raises(config_lib.ConfigError, match=rf"smallest need is "
                                                    rf"{need[small] / 2**30:.3g} GB \(1f1b m={small}"):
    Trainer(tiny_pp2(schedule="auto", costs=cost_file, auto_schedules=("1f1b",),
                     auto_microbatches=MICROBATCHES, memory_limit_gb=need[small] / 2**31))


def step_cpu_times(trainers, rounds=5):
  """Median process CPU seconds per step of each trainer, steps alternating. The 8 host devices
  share the cores, so CPU time is what a step costs here, whatever else loads the machine."""
  batches = [t.batch(0) for t in trainers]
  for t, b in zip(trainers, batches):
    jax.block_until_ready(t.step(b))
  times = [[] for _ in trainers]
  for _ in range(rounds):
    for i, (t, b) in enumerate(zip(trainers, batches)):
      c0 = time.process_time()
      jax.block_until_ready(t.step(b))
      times[i].append(time.process_time() - c0)
  return [statistics.median(x) for x in times]


def test_auto_choice_is_measured_among_the_fastest_of_its_grid(auto_trainer):
  trainer = auto_trainer[0]
  chosen = trainer.config.pipeline.microbatches
  other = Trainer(tiny_pp2(microbatches=next(m for m in MICROBATCHES if m != chosen)))
  mine, theirs = step_cpu_times([trainer, other])
  assert mine <= 1.1 * theirs, (chosen, mine, theirs)


def test_planned_and_measured_ticks_line_up_per_rank(auto_trainer, cost_file):
  trainer = auto_trainer[0]
  lowered = lowered_for(lm_schedule(trainer.config.pipeline, 2))
  prediction = costs_lib.load(cost_file).predict(lowered)
  with tempfile.TemporaryDirectory() as tmp:
    xspace, hlo = tick_trace.profile_step(trainer, tmp)
    measured = tick_trace.read_profile(xspace, hlo, trainer.mesh, lowered.num_ticks)
  # every tick of every rank, read from the trace, ran the branch the table names
  assert [[t.branch for t in ticks] for ticks in measured] == tick_trace.branch_of_table(lowered)
  for ticks in measured:
    assert all(0 < t.work_ns <= t.end_ns - t.start_ns for t in ticks)
    assert all(a.end_ns <= b.start_ns + 1 for a, b in zip(ticks, ticks[1:]))
  trace = json.loads(tick_trace.to_perfetto(lowered, prediction, measured))
  names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
           if e.get("name") == "thread_name"}
  assert {(r, "planned") for r in range(2)} | {(r, "measured") for r in range(2)} <= names
  per_tick = trace["otherData"]["per_tick"]
  assert len(per_tick) == lowered.num_ticks
  assert trace["otherData"]["planned_s"] == pytest.approx(sum(prediction.planned_tick_s))


@pytest.mark.parametrize("pipeline,pp,needle", [
    (dict(), 1, "chooses among pipeline schedules; set --config.mesh.pp to 2 or more"),
    (dict(auto_schedules=("1f1b", "zb-h3")), 2, "pipeline.auto_schedules has ['zb-h3']"),
    (dict(auto_microbatches=(3,)), 2, "entry 3 does not split the batch: data.batch=16 over 4 "
                                      "data ranks leaves 4 sequences each"),
    (dict(memory_limit_gb=-1.0), 2, "pipeline.memory_limit_gb=-1.0 must be >= 0"),
    (dict(costs="nowhere.json"), 2, "no such cost file 'nowhere.json'"),
    (dict(auto_schedules=("zb-v",)), 2, "the layers split into none of the stage counts [4]"),
])
def test_bad_auto_configs_fail_validation(pipeline, pp, needle):
  c = tiny.get_config()
  c.mesh.pp = pp
  c.pipeline.update(dict(schedule="auto", **pipeline))
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, 8)
  assert needle in str(e.value)


def test_bad_sweep_inputs_fail_before_anything_runs(tmp_path, capsys):
  out = str(tmp_path / "never")
  base = ["--config", "configs/tiny.py", "--out", out]
  assert sweep.main(base + ["--grid", "pipeline.schedul=1f1b,zb-h1"]) == 2
  assert "--grid key 'pipeline.schedul' is not a config field; did you mean " \
         "'pipeline.schedule'?" in capsys.readouterr().err
  assert sweep.main(base) == 2
  assert "the grid is empty" in capsys.readouterr().err
  assert sweep.main(base + ["--grid", "pipeline.microbatches="]) == 2
  assert "has no values" in capsys.readouterr().err
  assert sweep.main(base + ["--grid", "pipeline.microbatches=2,two"]) == 2
  assert "'two' is not a int" in capsys.readouterr().err
  assert sweep.main(base + ["--grid", "optimizer.lr=1e-3", "--config.mesh.ppp=2"]) == 2
  assert "did you mean 'mesh.pp'?" in capsys.readouterr().err
  assert not os.path.exists(out)


def test_sweep_runs_cells_records_failures_and_resumes(tmp_path):
  out = str(tmp_path / "sweep")
  # two cells: one trains, a negative learning rate fails
  cmd = [sys.executable, "-m", "experiments.sweep", "--config", "configs/tiny.py",
         "--config.mesh.pp=2", "--config.pipeline.microbatches=2", "--grid", "optimizer.lr=1e-2,-1",
         "--steps", "3", "--log_every", "1", "--repeats", "2", "--out", out]
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 1, proc.stderr[-3000:]  # one cell failed, the other ran
  with open(os.path.join(out, "sweep.csv")) as f:
    rows = {r["cell"]: r for r in csv.DictReader(f)}
  assert [rows[f"lr={v}"]["status"] for v in ("1e-2", "-1")] == ["ok", "failed"]
  assert "optimizer.lr=-1.0 must be >= 0" in rows["lr=-1"]["error"]
  r = rows["lr=1e-2"]
  workdir = os.path.join(out, "lr=1e-2")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f]
  windows = [m["step_time_s"] for m in metrics if "step_time_s" in m]
  assert float(r["step_ms"]) == pytest.approx(1e3 * statistics.median(windows))
  assert float(r["final_loss"]) == [m["loss"] for m in metrics if "loss" in m][-1]
  with open(os.path.join(workdir, "compile.json")) as f:
    assert float(r["peak_mb"]) == pytest.approx(json.load(f)["peak_bytes"] / 2**20)
  assert r["schedule"] == "1f1b" and int(r["ticks"]) > 0
  costs = costs_lib.load(os.path.join(workdir, "costs.json"))
  paired = costs.setup["paired"]  # the cell's own step, timed in the rounds of its costs
  assert (paired["schedule"], paired["microbatches"]) == ("1f1b", 2)
  pred = costs.predict(lowered_for(lm_schedule(tiny_pp2(microbatches=2).pipeline, 2)))
  assert float(r["predicted_ms"]) == pytest.approx(1e3 * pred.cpu_s)  # CPU: shared cores
  assert float(r["paired_ms"]) == pytest.approx(1e3 * paired["step_cpu_s"])
  assert os.path.getsize(os.path.join(out, "sweep.png")) > 0
  with open(os.path.join(out, "sweep.md")) as f:
    assert "| lr=-1 | failed: train exited 1: config error: optimizer.lr=-1.0" in f.read()
  # the same command again: finished cells are skipped, the failed one runs again
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert again.stdout.count("done before, skipped") == 1 and "lr=-1: running" in again.stdout
