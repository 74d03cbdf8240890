"""A config sweep of tiny's 1F1B on pp = 2: its cells, their measured costs and predictions,
auto's choice among them and in the Trainer, planned vs measured ticks; bad inputs."""

import csv
import functools
import json
import math
import os
import statistics
import subprocess
import sys

import jax
import pytest

from configs import tiny
from experiments import sweep
from jaxpipe.models import transformer
from jaxpipe.pipeline.api import lowered_for
from jaxpipe.planning import auto as auto_lib
from jaxpipe.planning import costs as costs_lib
from jaxpipe.planning import ticks
from jaxpipe.runtime import cli
from jaxpipe.training import config as config_lib
from jaxpipe.training.pipeline_lm import lm_schedule
from jaxpipe.training.trainer import Trainer
from tests import helpers

ROOT = helpers.ROOT
MICROBATCHES = (1, 4)  # cells that train: tiny's 2 layers as 2 stages, batch 16 over dp = 4
FAILS = 3  # 16 sequences do not split over 4 data ranks x 3 micro-batches


def tiny_pp2(**pipeline):
  c = tiny.get_config()
  c.mesh.pp = 2
  c.pipeline.update(pipeline)
  return c


def lowered(m):
  return lowered_for(lm_schedule(tiny_pp2(microbatches=m).pipeline, 2))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  """The sweep, run once: -> (its directory, the command, its process, {cell: CSV row})."""
  tmp = tmp_path_factory.mktemp("sweep")
  out = str(tmp / "out")
  cmd = [
      sys.executable,
      "-m",
      "experiments.sweep",
      "--config",
      "configs/tiny.py",
      "--config.mesh.pp=2",
      "--grid",
      f"pipeline.microbatches=1,4,{FAILS}",
      "--steps",
      "3",
      "--log_every",
      "1",
      "--repeats",
      "1",
      "--trace",
      "--out",
      out,
  ]
  env = {
      **os.environ,
      "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  with open(os.path.join(out, "sweep.csv")) as f:
    rows = {r["cell"]: r for r in csv.DictReader(f)}
  return out, (cmd, env), proc, rows


def cell_costs(out, m):
  return os.path.join(out, f"microbatches={m}", "costs.json")


def test_sweep_runs_cells_records_failures_and_resumes(swept):
  out, (cmd, env), proc, rows = swept
  assert proc.returncode == 1, proc.stderr[-3000:]  # one cell failed, the others ran
  assert [rows[f"microbatches={m}"]["status"] for m in (1, 4, FAILS)] == ["ok", "ok", "failed"]
  assert (
      "data.batch=16 is not divisible by data-parallel ranks"
      in rows[f"microbatches={FAILS}"]["error"]
  )
  for m in MICROBATCHES:
    r = rows[f"microbatches={m}"]
    workdir = os.path.join(out, f"microbatches={m}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      metrics = [json.loads(line) for line in f]
    windows = [x["step_time_s"] for x in metrics if "step_time_s" in x]
    assert float(r["step_ms"]) == pytest.approx(1e3 * statistics.median(windows))
    assert float(r["final_loss"]) == [x["loss"] for x in metrics if "loss" in x][-1]
    with open(os.path.join(workdir, "compile.json")) as f:
      assert float(r["peak_mb"]) == pytest.approx(json.load(f)["peak_bytes"] / 2**20)
    assert r["schedule"] == "1f1b" and int(r["ticks"]) == lowered(m).num_ticks
    costs = costs_lib.load(cell_costs(out, m))
    paired = costs.setup["paired"]  # the cell's own step, timed in the rounds of its costs
    assert (paired["schedule"], paired["microbatches"]) == ("1f1b", m)
    pred = costs.predict(lowered(m))
    assert float(r["predicted_ms"]) == pytest.approx(1e3 * pred.cpu_s)  # CPU: shared cores
    assert float(r["paired_ms"]) == pytest.approx(1e3 * paired["step_cpu_s"])
  assert os.path.getsize(os.path.join(out, "sweep.png")) > 0
  # each cell's measurement times the cell's own step (same train settings, so the same
  # program): one train step compiled per cell, the second read from the compilation cache
  cached = os.listdir(env["JAX_COMPILATION_CACHE_DIR"])
  assert sum(f.startswith("jit_train_step-") for f in cached) == len(MICROBATCHES), cached
  with open(os.path.join(out, "sweep.md")) as f:
    assert f"| microbatches={FAILS} | failed: train exited 2: error: data.batch=16" in f.read()
  # the same command again: finished cells are skipped, the failed one runs again
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert again.stdout.count("done before, skipped") == 2
  assert f"microbatches={FAILS}: running" in again.stdout


def test_measured_cost_files_are_complete_and_their_bytes_exact(swept):
  out = swept[0]
  cfg = config_lib.model_config(tiny_pp2())
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  nbytes = lambda tree: sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))
  layers = nbytes(params["layers"])
  shared = nbytes({k: v for k, v in params.items() if k != "layers"})
  for m in MICROBATCHES:
    costs = costs_lib.load(cell_costs(out, m))  # every part present, non-negative
    e = costs.entry(m, 2)
    b = 16 // (4 * m)  # batch 16 over dp = 4 data ranks and m micro-batches
    assert e.bytes["activation"] == b * 16 * 32 * 4  # [b, seq 16, d_model 32] float32
    # one layer per stage; I keeps for W the cotangents at q, k, v ((H + 2 KV) K), gate and up
    # (2 d_ff) and the two products into the residual stream (2 d) per token, and the two norms'
    # scale cotangents (d each)
    kept = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 2 * cfg.d_ff + 2 * cfg.d_model
    assert e.bytes["wg"] == (b * 16 * kept + 2 * cfg.d_model) * 4
    assert e.bytes["residual"] > e.bytes["activation"] and e.bytes["work"] > 0
    # AdamW keeps two moments beside each parameter; the layer stack is split over pp = 2
    assert costs.step["layer_state_bytes"] == 3 * layers // 2
    assert costs.step["layer_grad_bytes"] == layers // 2
    assert costs.step["shared_grad_bytes"] == shared
    assert 3 * shared <= costs.step["shared_state_bytes"] <= 3 * shared + 64  # + step counts
    cores = len(os.sched_getaffinity(0))
    assert costs.devices == costs_lib.Devices("cpu", 8, cores, cores >= 8)


@pytest.fixture(scope="module")
def both_costs(swept):
  """The cells' cost files merged by the sweep (same model and mesh), as auto reads them."""
  return os.path.join(swept[0], "costs.json")


@pytest.fixture(scope="module")
def ranking(both_costs):
  """auto's ranking of the swept cells from their merged costs."""
  return auto_lib.rank(2, MICROBATCHES, costs_lib.load(both_costs), layers=2, names=("1f1b",))


def test_the_sweep_names_autos_choice_over_its_cells(swept, ranking):
  with open(os.path.join(swept[0], "sweep.md")) as f:
    assert f"auto over the cells' costs chooses {ranking.best.label}" in f.read()


@pytest.mark.slow  # a timing comparison: under `pytest -n 2` the other worker shares the cores
def test_auto_choice_is_measured_among_the_top_cells_of_the_sweep(swept, ranking):
  rows = swept[3]
  cpu = {m: float(rows[f"microbatches={m}"]["paired_ms"]) for m in MICROBATCHES}
  # each cell's step CPU time, measured in the rounds of its own costs; the choice must be
  # within 10% of the fastest
  assert cpu[ranking.best.microbatches] <= 1.1 * min(cpu.values()), (ranking.report(), cpu)


def auto_config(costs, **pipeline):
  return tiny_pp2(
      schedule="auto",
      costs=costs,
      auto_schedules=("1f1b",),
      auto_microbatches=MICROBATCHES,
      **pipeline,
  )


def test_auto_trains_the_best_ranked_candidate_and_keeps_its_choice(both_costs, tmp_path):
  config = auto_config(both_costs)
  costs = costs_lib.load(both_costs)
  best = min(MICROBATCHES, key=lambda m: costs.predict(lowered(m)).step_s)
  trainer = Trainer(config, str(tmp_path))
  assert config.pipeline.schedule == "auto"  # the caller's config is left alone
  assert (trainer.config.pipeline.schedule, trainer.config.pipeline.microbatches) == ("1f1b", best)
  assert f"auto chose 1f1b m={best}" in trainer.auto_report
  with open(tmp_path / "auto.json") as f:
    assert json.load(f)["choice"]["microbatches"] == best
  again = Trainer(config.copy_and_resolve_references(), str(tmp_path))  # resumed: same choice
  assert again.config.pipeline.microbatches == best and again.auto_report == trainer.auto_report


def test_auto_respects_the_memory_limit_and_errors_when_nothing_fits(both_costs):
  costs = costs_lib.load(both_costs)
  need = {m: costs.predict(lowered(m)).memory_bytes for m in MICROBATCHES}
  small, big = sorted(MICROBATCHES, key=need.get)
  assert need[small] < need[big]
  trainer = Trainer(auto_config(both_costs, memory_limit_gb=(need[small] + need[big]) / 2**31))
  assert trainer.config.pipeline.microbatches == small
  assert f"1f1b m={big}" in trainer.auto_report and "over the memory limit" in trainer.auto_report
  with pytest.raises(
      config_lib.ConfigError,
      match=rf"smallest need is {need[small] / 2**30:.3g} GB \(1f1b m={small}",
  ):
    Trainer(auto_config(both_costs, memory_limit_gb=need[small] / 2**31))


def test_planned_and_measured_ticks_line_up_per_rank(swept):
  out = swept[0]
  m = 4
  lo = lowered(m)
  with open(os.path.join(out, f"microbatches={m}", "ticks.perfetto.json")) as f:
    trace = json.load(f)
  per_tick = trace["otherData"]["per_tick"]
  # every tick of every rank, read back from the profiler trace, ran the branch its table names
  measured = [[row["branch"][r] for row in per_tick] for r in range(2)]
  assert measured == ticks.branch_of_table(lo)
  for row in per_tick:
    assert all(0 <= w for w in row["measured_work_s"]) and row["measured_s"] > 0
  prediction = costs_lib.load(cell_costs(out, m)).predict(lo)
  assert [row["planned_s"] for row in per_tick] == pytest.approx(list(prediction.planned_tick_s))
  names = {
      (e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e.get("name") == "thread_name"
  }
  assert {(r, t) for r in range(2) for t in ("planned", "measured")} <= names


@pytest.mark.parametrize(
    "pipeline,pp,needle",
    [
        (dict(), 1, "chooses among pipeline schedules; set --config.mesh.pp to 2 or more"),
        (dict(auto_schedules=("1f1b", "zb-h3")), 2, "pipeline.auto_schedules has ['zb-h3']"),
        (
            dict(auto_microbatches=(3,)),
            2,
            "entry 3 does not split the batch: data.batch=16 over 4 "
            "data ranks leaves 4 sequences each",
        ),
        (dict(memory_limit_gb=-1.0), 2, "pipeline.memory_limit_gb=-1.0 must be >= 0"),
        (dict(costs="nowhere.json"), 2, "no such cost file 'nowhere.json'"),
        (dict(auto_schedules=("zb-v",)), 2, "the layers split into none of the stage counts [4]"),
    ],
)
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
  main = functools.partial(cli.call, sweep.main, sweep.FLAGS, known_only=True)
  assert main(base + ["--grid", "pipeline.schedul=1f1b,zb-h1"]) == 2
  assert (
      "--grid key 'pipeline.schedul' is not a config field; did you mean "
      "'pipeline.schedule'?" in capsys.readouterr().err
  )
  assert main(base) == 2
  assert "the grid is empty" in capsys.readouterr().err
  assert main(base + ["--grid", "pipeline.microbatches="]) == 2
  assert "has no values" in capsys.readouterr().err
  assert main(base + ["--grid", "pipeline.microbatches=2,two"]) == 2
  assert (
      "'two' is not of type int, the type of config field pipeline.microbatches"
      in capsys.readouterr().err
  )
  assert main(base + ["--grid", "optimizer.lr=1e-3", "--config.mesh.ppp=2"]) == 2
  assert "did you mean 'mesh.pp'?" in capsys.readouterr().err
  assert not os.path.exists(out)
