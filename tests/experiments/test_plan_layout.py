"""The layout planner: ZeRO's bytes per parameter, per-device bytes against compiled programs,
layouts that do not fit, bad input.

  python -m pytest -q -x -p no:cacheprovider -n 0 tests/experiments/test_plan_layout.py
"""

import dataclasses

import pytest

from experiments import plan_layout
from jaxpipe.planning import layout as L
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


# a MoE model of the quickstart's size: 8 experts of d_ff 192 and one shared, every second layer
MOE = L.Model(
    "moe",
    1024,
    128,
    4,
    4,
    2,
    32,
    384,
    experts=8,
    top_k=2,
    expert_d_ff=192,
    shared_experts=1,
    moe_every=2,
)
BATCH = L.Batch(64, 4096)


def test_the_optimizer_splits_over_dp_ep_and_cp():
  """zero.py's OPTIMIZER_AXES are dp, ep and cp (Megatron's distributed optimizer over dp x
  cp): at the same dp a cp of 2 halves the moments, and under zero2 and fsdp the gradients,
  and under fsdp the parameters, exactly as a dp of 8 does; 'none' splits nothing."""
  model = plan_layout.MODELS["llama3-8b"]
  for shard in ("zero1", "zero2", "fsdp"):
    dp4 = L.memory(model, L.Layout(dp=4, shard=shard), BATCH)
    cp2 = L.memory(model, L.Layout(dp=4, cp=2, shard=shard), BATCH)
    dp8 = L.memory(model, L.Layout(dp=8, shard=shard), BATCH)
    assert cp2.optimizer == pytest.approx(dp4.optimizer / 2) == pytest.approx(dp8.optimizer)
    assert cp2.grads == pytest.approx(dp8.grads), shard
    assert cp2.weights == pytest.approx(dp8.weights), shard
  one = L.memory(model, L.Layout(dp=4, shard="none"), BATCH)
  assert L.memory(model, L.Layout(dp=4, cp=2), BATCH).optimizer == pytest.approx(one.optimizer)
  assert L.zero_groups(L.Layout(dp=4, cp=2, ep=2)) == (16, 8)


def test_experts_stay_whole_over_tp_and_split_over_dp_only():
  """jaxpipe keeps experts (routed and shared) whole over tp; their optimizer state splits over
  dp alone (ep splits them already), the dense weights' over dp x ep."""
  whole = L.device_params(MOE, L.Layout(ep=2, dp=4))
  for sp in (False, True):
    split = L.device_params(MOE, L.Layout(ep=2, dp=2, tp=2, sp=sp))
    assert split["expert"] == pytest.approx(whole["expert"])
    assert split["expert"] == pytest.approx(2 * 8 * 3 * 128 * 192 / 2)  # 2 MoE layers, ep 2
    # only attention, the dense FFN and the vocabulary halve; the shared experts do not
    halves = 2 * MOE.layer_params(False)["tp"] + 2 * MOE.layer_params(True)["tp"]
    halves += MOE.embedding_params
    assert whole["dense"] - split["dense"] == pytest.approx(halves / 2)
    assert MOE.layer_params(True)["shared"] == 3 * 128 * 192
  mem = L.memory(MOE, L.Layout(ep=2, dp=4, shard="zero1"), BATCH, L.FP32)
  assert mem.optimizer == pytest.approx(8 * (whole["dense"] / 8 + whole["expert"] / 4))
  # the experts' activations split over tp only with sequence parallelism
  flat = L.Layout(ep=2, dp=4)
  per = lambda lay: L.GPU_ACTIVATIONS.layer_elements(MOE, lay, 4096, True)
  dense_part = lambda lay: L.GPU_ACTIVATIONS.layer_elements(MOE, lay, 4096, False) - (
      3 * 384 / lay.tp
  )
  experts = per(flat) - dense_part(flat)
  tp2 = L.Layout(ep=2, dp=2, tp=2)
  assert per(tp2) - dense_part(tp2) == pytest.approx(experts)
  tp2sp = L.Layout(ep=2, dp=2, tp=2, sp=True)
  assert per(tp2sp) - dense_part(tp2sp) == pytest.approx(experts / 2)


def test_zero2_in_a_pipeline_holds_whole_gradients_and_fsdp_gathers_only_embedding_and_head():
  """zero2: the executor adds the micro-batches' gradients into a whole accumulator and
  reduce-scatters it after its loop, so it holds zero1's whole gradients plus their split copy.
  fsdp: each layer is gathered inside its stage and its gradient reduce-scattered there, so the
  layers' weights and gradients are split as without a pipeline; only the embedding and final
  norm are gathered whole (and their gradients returned whole) where the executor begins. The
  moments split as zero1's."""
  model = plan_layout.MODELS["llama3-8b"]
  staged = lambda s: L.Layout(pp=2, dp=4, microbatches=4, shard=s)
  z1, z2, fs = (L.memory(model, staged(s), BATCH) for s in ("zero1", "zero2", "fsdp"))
  n, g, p = z1.params, L.MIXED.grad, L.MIXED.param
  assert z2.grads == pytest.approx(z1.grads + n * g / 4)
  assert z2.weights == pytest.approx(z1.weights) == pytest.approx(n * p)
  outer = model.embedding_params + model.d_model
  assert fs.weights == pytest.approx(n * p / 4 + outer * p)
  # the gradients split (the embedding's whole from the executor, beside its split copy), the
  # accumulator split but for the embedding and head's
  assert fs.grads == pytest.approx(n * g / 4 + outer * g + (n - outer) * g / 4 + outer * g)
  assert z1.optimizer == pytest.approx(z2.optimizer) == pytest.approx(fs.optimizer)
  # without a pipeline zero2 and fsdp split the gradients (and fsdp the parameters)
  flat = lambda s: L.Layout(dp=4, microbatches=4, shard=s)
  f1, f2, ff = (L.memory(model, flat(s), BATCH) for s in ("zero1", "zero2", "fsdp"))
  assert f2.grads == pytest.approx(f1.grads / 4)
  assert ff.weights == pytest.approx(f1.weights / 4)


def test_moe_with_tp_and_no_sp_runs_the_experts_on_every_tp_rank():
  cluster = L.h200(8)
  t = lambda sp: L.step_time(MOE, L.Layout(ep=2, dp=2, tp=2, sp=sp), BATCH, cluster).compute_s
  assert t(False) > t(True)


def test_a_layout_that_does_not_fit_is_reported():
  model, batch = plan_layout.MODELS["llama3-405b"], plan_layout.BATCHES["llama3-405b"]
  plans = L.search(model, batch, L.h200(8), schedules=("1f1b",), recomputes=("full",))
  assert plans and not any(p.fits for p in plans)
  text = plan_layout.cluster_table("llama3-405b", [8], 3)
  assert "nothing fits" in text


def test_deepseek_v3s_published_layout_is_priced_with_its_uneven_stages():
  """PP 16 x EP 64 x ZeRO-1 on 2,048 devices under DualPipe: 61 layers over 16 stages, which
  jaxpipe's stages cannot hold, priced with the 4-layer stages setting the pace (64/61 of the
  even compute) and beside the planner's picks in the table."""
  model, batch = plan_layout.MODELS["deepseek-v3"], plan_layout.BATCHES["deepseek-v3"]
  devices, layouts = plan_layout.PUBLISHED_LAYOUTS["deepseek-v3"]
  published = layouts[0]
  assert (devices, published.devices, published.schedule) == (2048, 2048, "dualpipe")
  assert (published.pp, published.ep, published.shard, published.tp) == (16, 64, "zero1", 1)
  even = dataclasses.replace(published, uneven=False)
  with pytest.raises(L.LayoutError, match=r"61 layers do not split into the 16 stages of dual"):
    L.memory(model, even, batch)
  cluster = L.h200(devices)
  flat = L.Layout(ep=64, dp=2, cp=16)  # the same FLOPs and devices, no pipeline
  ratio = (
      L.step_time(model, published, batch, cluster).compute_s
      / L.step_time(model, flat, batch, cluster).compute_s
  )
  assert ratio == pytest.approx(64 / 61, rel=1e-12)
  text = plan_layout.cluster_table("deepseek-v3", [], 3)
  assert "| 2,048 published | pp16xep64xdp2 dualpipe m40 zero1 uneven |" in text


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


def test_the_arguments_at_cp_2_are_the_stored_bytes_priced():
  """tiny at cp 2 x dp 4 under zero1: the compiled step's arguments (the state and the batch)
  are the planner's weights, moments and batch, the moments split over dp 4 x cp 2."""
  r = plan_layout.check_one(plan_layout._c("tiny", mesh__cp=2, optimizer__shard="zero1"))
  m = r["memory"]
  assert m.weights + m.optimizer + m.batch == pytest.approx(r["analysis"]["argument"], rel=1e-3)
