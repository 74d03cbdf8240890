"""The layout planner: ZeRO's bytes per parameter, per-device bytes against compiled programs,
layouts that do not fit, bad input.

  python -m pytest -q -x -p no:cacheprovider -n 0 tests/experiments/test_plan_layout.py
"""

import pytest

from experiments import plan_layout
from jaxpipe.pipeline.ir import layout as L
from jaxpipe.runtime import cli


def test_zero_formulas_match_the_anchors():
  # Rajbhandari et al. (SC20), mixed-precision Adam: 16, 4 + 12/Nd, 2 + 14/Nd, 16/Nd
  for nd in (1, 8, 64):
    assert L.zero_bytes_per_param("none", nd) == 16
    assert L.zero_bytes_per_param("zero1", nd) == pytest.approx(4 + 12 / nd)
    assert L.zero_bytes_per_param("zero2", nd) == pytest.approx(2 + 14 / nd)
    assert L.zero_bytes_per_param("fsdp", nd) == pytest.approx(16 / nd)
  # float32 training (jaxpipe today): weights 4, gradients 4, moments 8
  assert L.zero_bytes_per_param("none", 4, L.FP32) == 16
  assert L.zero_bytes_per_param("zero1", 4, L.FP32) == 8 + 8 / 4


def test_model_sizes():
  assert plan_layout.MODELS["llama3-8b"].params == pytest.approx(8.03e9, rel=0.01)
  assert plan_layout.MODELS["llama3-70b"].params == pytest.approx(70.6e9, rel=0.01)
  assert plan_layout.MODELS["llama3-405b"].params == pytest.approx(405.9e9, rel=0.01)
  ds = plan_layout.MODELS["deepseek-v3"]
  assert ds.params == pytest.approx(671e9, rel=0.01)
  assert ds.active_params == pytest.approx(37e9, rel=0.03)


# tiny shapes on the data-parallel path, with gradient accumulation, and pipelined (1F1B)
SMALL = (
    plan_layout._c("tiny"),
    plan_layout._c("tiny", pipeline__microbatches=2),
    plan_layout._c("tiny", mesh__pp=2, pipeline__microbatches=2),
)


@pytest.mark.parametrize("check", SMALL, ids=lambda c: c.label)
def test_bytes_within_5_percent_of_memory_analysis(check):
  r = plan_layout.check_one(check)
  assert abs(r["error"]) <= 0.05, r


def test_a_layout_that_does_not_fit_is_reported():
  model, batch = plan_layout.MODELS["llama3-405b"], plan_layout.BATCHES["llama3-405b"]
  plans = L.search(model, batch, L.h200(8), schedules=("1f1b",), recomputes=("full",))
  assert plans and not any(p.fits for p in plans)
  text = plan_layout.cluster_table("llama3-405b", [8], 3)
  assert "nothing fits" in text


def test_tp_must_divide_the_heads():
  model = plan_layout.MODELS["llama3-8b"]
  with pytest.raises(L.LayoutError, match="tp=3 does not divide n_heads=32") as e:
    L.memory(model, L.Layout(tp=3, dp=1), L.Batch(8, 1024))
  assert "\n" not in str(e.value)
  with pytest.raises(L.LayoutError, match="needs a MoE model"):
    L.memory(model, L.Layout(ep=2), L.Batch(8, 1024))
  with pytest.raises(L.LayoutError, match="shard"):
    L.memory(model, L.Layout(dp=2, shard="zero4"), L.Batch(8, 1024))


def test_bad_flag_is_one_line(capsys):
  code = cli.call(plan_layout.main, plan_layout.FLAGS, ["--tables", "--models", "gpt5"])
  assert code == cli.USAGE
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "gpt5" in err
