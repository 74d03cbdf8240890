"""experiments.fp8_bench's seeds part: its table against the runs it saved,
and a rerun keeps them."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers

ROOT = helpers.ROOT
SEEDS = (0, 1)


def _bench(out, *extra):
  cmd = [
      sys.executable,
      "-m",
      "experiments.fp8_bench",
      "--parts",
      "seeds",
      "--steps",
      "2",
      "--pp",
      "1",
      "--runs",
      "float32,delayed",
      "--out",
      str(out),
      *extra,
  ]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _row(stdout, label):
  line = next(l for l in stdout.splitlines() if l.startswith(f"| data-parallel | {label} |"))
  return [c.strip() for c in line.strip("|").split("|")][2:]


@pytest.mark.slow  # a benchmark run over seeds: a minute and a half of CPU
def test_seed_table_is_the_mean_over_seeds_and_a_rerun_keeps_the_runs(tmp_path):
  first = _bench(tmp_path, "--seeds", ",".join(map(str, SEEDS)))
  assert first.returncode == 0, first.stderr[-3000:]
  runs = json.load(open(tmp_path / "seeds.json"))
  assert runs["steps"] == 2 and sorted(runs["runs"]) == sorted(
      f"dp/{label}/{s}" for label in ("float32", "delayed") for s in SEEDS
  )
  final = {k: v["losses"][-1] for k, v in runs["runs"].items()}
  evals = {k: v["eval_loss"] for k, v in runs["runs"].items()}
  assert final["dp/float32/0"] != final["dp/float32/1"]  # the seed changes the initialisation
  for measure, at in ((final, 0), (evals, 6)):
    got = [measure[f"dp/delayed/{s}"] for s in SEEDS]
    base = [measure[f"dp/float32/{s}"] for s in SEEDS]
    row, base_row = _row(first.stdout, "delayed"), _row(first.stdout, "float32")
    assert float(row[at]) == pytest.approx(np.mean(got), abs=5e-5)
    assert float(base_row[at]) == pytest.approx(np.mean(base), abs=5e-5)
    assert float(row[at + 1].rstrip("%")) == pytest.approx(
        100 * (np.mean(got) / np.mean(base) - 1), abs=0.005
    )
    paired = [100 * (a / b - 1) for a, b in zip(got, base)]
    low, high = (float(v.rstrip("%")) for v in row[at + 2].split(" .. "))
    assert (low, high) == pytest.approx((min(paired), max(paired)), abs=0.005)

  again = _bench(tmp_path, "--seeds", ",".join(map(str, SEEDS)))
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("(kept from an earlier run)") == 2 * len(SEEDS)
  assert _row(again.stdout, "delayed") == _row(first.stdout, "delayed")


def test_unknown_part_is_refused():
  r = subprocess.run(
      [sys.executable, "-m", "experiments.fp8_bench", "--parts", "seed"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 2 and "--parts: unknown ['seed']" in r.stderr, r.stderr
