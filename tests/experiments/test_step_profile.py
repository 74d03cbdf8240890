"""`experiments.step_profile`: its FLOP count of a decode step agrees with the model's analytic
forward FLOPs (`jaxpipe.models.flops`)."""

import subprocess
import sys

import numpy as np
import pytest

from experiments import step_profile
from experiments.shapes import SHAPES
from jaxpipe.models import flops
from jaxpipe.runtime import cli
from kernels_cpu import matmul as onednn
from tests import helpers


def test_a_decode_step_counts_the_forward_flops_of_its_tokens():
  cfg = SHAPES["smollm2-135m"]
  # one token attending itself: the forward pass of a one-token sequence, attention not halved
  assert step_profile.decode_flops(cfg, 1, 1) == flops.forward_flops_per_sequence(cfg, 1, False)
  # each more token of context adds its scores and values: 2 x 2 x heads x head_dim a layer
  extra = step_profile.decode_flops(cfg, 1, 101) - step_profile.decode_flops(cfg, 1, 1)
  assert extra == 100 * 4 * cfg.n_heads * cfg.head_dim * cfg.n_layers
  assert step_profile.decode_flops(cfg, 64, 1) == 64 * step_profile.decode_flops(cfg, 1, 1)


def test_a_prefill_step_counts_the_head_on_its_last_token_alone():
  cfg = SHAPES["smollm2-135m"]
  d, f, h, g, k, v = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab
  n = 1024
  # per layer: q, k, v and out projections, gate, up and down, causal scores and values (half)
  layer = 2 * n * d * (h + 2 * g) * k + 2 * n * h * k * d + 3 * 2 * n * d * f + 2 * n * n * h * k
  assert step_profile.prefill_flops(cfg, n) == cfg.n_layers * layer + 2 * d * v


@pytest.mark.skipif(onednn.unavailable() is not None, reason="needs the oneDNN kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_packed_kernels_are_timed_per_gemm_and_summed_per_row_count(dtype):
  cfg = SHAPES["toy"]
  rows = step_profile.packed_kernels(cfg, [8, 16], rounds=2, dtype=dtype)
  names = [
      f"{n} {m}x{k}x{c} x{1 if n == 'lm head' else cfg.n_layers}"
      for n, (m, k, c) in step_profile.gemms(cfg, 8).items()
  ]
  assert [r[0] for r in rows[: len(names)]] == names and rows[len(names)][0] == "all, M = 8"
  assert rows[-1][0] == "all, M = 16" and len(rows) == 2 * (len(names) + 1)
  # float32 past PANELS_ROWS runs oneDNN on both sides: left out; bfloat16 at every row count
  past = step_profile.packed_kernels(cfg, [onednn.PANELS_ROWS + 1], rounds=1, dtype=dtype)
  assert len(past) == (0 if dtype == "float32" else len(names) + 1)
  for part in (rows[: len(names) + 1], rows[len(names) + 1 :]):
    for i in (1, 2):  # the sums are the GEMMs' own
      assert part[-1][i] == pytest.approx(sum(r[i] for r in part[:-1]))
      assert all(r[i] > 0 for r in part)


@pytest.mark.parametrize("who", ["xla", "onednn", "prepacked", "torch"])
def test_each_contender_computes_the_gemm_it_is_timed_on(who):
  if who in ("onednn", "prepacked") and onednn.unavailable() is not None:
    pytest.skip("needs the oneDNN kernel")
  mm, kk, n = 8, 48, 40
  got = np.asarray(step_profile.gemm_run(who, mm, kk, n, "float32", np.random.default_rng(3))())
  rng = np.random.default_rng(3)  # the same operands, drawn as gemm_run draws them
  kind = np.float32 if who == "torch" else np.float64
  a, b = rng.standard_normal((mm, kk), kind), rng.standard_normal((kk, n), kind)
  want = a.astype(np.float32) @ b.astype(np.float32)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_peak_is_timed_again_on_the_fastest_contenders_own_gemm(monkeypatch):
  made = []

  def fake_run(who, mm, kk, n, dtype, rng):
    made.append((who, mm, kk, n, dtype))
    return lambda: None

  monkeypatch.setattr(step_profile, "gemm_run", fake_run)
  monkeypatch.setattr(step_profile, "_median", lambda run, reps, budget_s: 0.5)
  probe = step_profile.peak_probe("prepacked", "gate+up 1024x576x3072", "bfloat16")
  assert made == [("prepacked", 1024, 576, 3072, "bfloat16")]
  assert probe() == pytest.approx(2 * 1024 * 576 * 3072 / 0.5 / 1e9)


def test_gemm_timings_take_the_median_within_a_budget(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(step_profile.time, "perf_counter", lambda: now[0])

  def runs_lasting(seconds):
    calls = []

    def run():
      calls.append(1)
      if len(calls) > 2:  # after the two warm-up calls, each run lasts its seconds
        now[0] += seconds[len(calls) - 3]

    return run, calls

  run, calls = runs_lasting([1, 9, 3, 2, 8, 7, 1])
  assert step_profile._median(run, reps=7, budget_s=100.0) == 3.0  # the median, not the 1
  assert len(calls) == 2 + 7  # reps bounds the runs when the budget does not
  run, calls = runs_lasting([1.0] * 50)
  assert step_profile._median(run, reps=50, budget_s=2.0) == 1.0
  assert len(calls) == 2 + 5  # past the budget after 2, but 5 at least
  run, calls = runs_lasting([0.25] * 50)
  step_profile._median(run, reps=50, budget_s=2.0)
  assert len(calls) == 2 + 8  # stops once the runs took the budget


def test_no_timed_runs_is_a_one_line_error():
  r = subprocess.run(
      [sys.executable, "-m", "experiments.step_profile", "--reps=0"],
      cwd=helpers.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == cli.USAGE, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --reps=0 must be 1 or more"), r.stderr
  assert r.stdout == ""
