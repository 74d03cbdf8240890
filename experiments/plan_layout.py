"""The layout planner: per-device bytes and step time of a model x layout x cluster, checked here
against compiled programs and tabled for H200 clusters.

  python -m experiments.plan_layout --check [--layouts 24] [--out DIR]
  python -m experiments.plan_layout --tables [--models llama3-8b,llama3-70b,llama3-405b,deepseek-v3]
      [--devices 8,64,512,2048,16384] [--top 3] [--out DIR]

`--check` compiles the Trainer's train step for each of the small layouts in `CHECKS` (tiny
and quickstart shapes, pp 1, 2 and 4, several schedules and micro-batch counts, dp, ep and cp
variations, dense and MoE) on the 8 host devices and compares the planner's per-device total
with `compiled.memory_analysis()`: argument + output - alias + temporaries, the peak the
Trainer records (`Trainer.compile`). The planner's model (`jaxpipe/planning/layout.py`) is
pure Python; what XLA:CPU keeps per token is calibrated in `CPU_ACTIVATIONS` (its docstring
names the programs). `--tables` ranks every layout the planner considers for each model and
cluster size and prints the fastest that fit, beside the published layouts (`PUBLISHED`).
Both write markdown to DIR (check.md, tables.md) when --out is given.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Sequence

from absl import app, flags

from jaxpipe.planning import layout as L
from jaxpipe.runtime import cli
from jaxpipe.training import plan

FLAGS = cli.flag_values(__name__)
_CHECK = flags.DEFINE_bool("check", False, "Compile small layouts and compare.", flag_values=FLAGS)
_TABLES = flags.DEFINE_bool("tables", False, "Cluster-scale tables.", flag_values=FLAGS)
_LAYOUTS = flags.DEFINE_integer(
    "layouts", 0, "Check only the first N layouts; 0 = all.", flag_values=FLAGS
)
_MODELS = flags.DEFINE_list(
    "models",
    ["llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3"],
    "Models for --tables.",
    flag_values=FLAGS,
)
_DEVICES = flags.DEFINE_list(
    "devices",
    ["8", "64", "512", "2048", "16384"],
    "Cluster sizes (H200s) for --tables.",
    flag_values=FLAGS,
)
_TOP = flags.DEFINE_integer("top", 3, "Layouts per model and cluster size.", flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "Directory for check.md / tables.md.", flag_values=FLAGS)

# --- the models at cluster scale ----------------------------------------------------------------

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, table 3): GQA with 8 KV heads, head_dim 128,
# vocabulary 128,256, untied. DeepSeek-V3 (technical report, 2024): 61 layers, hidden 7168, the
# first 3 dense (d_ff 18,432), then 256 routed experts (d_ff 2048) + 1 shared, top-8; MLA
# attention with 128 heads (q rank 1536, kv rank 512, qk 128 + 64 rope, v 128): its weights per
# layer are given directly (187,107,328), its activations approximated as 128 heads of 128.
MODELS = {
    "llama3-8b": L.Model("Llama-3-8B", 128256, 4096, 32, 32, 8, 128, 14336),
    "llama3-70b": L.Model("Llama-3-70B", 128256, 8192, 80, 64, 8, 128, 28672),
    "llama3-405b": L.Model("Llama-3-405B", 128256, 16384, 126, 128, 8, 128, 53248),
    "deepseek-v3": L.Model(
        "DeepSeek-V3",
        129280,
        7168,
        61,
        128,
        128,
        128,
        18432,
        experts=256,
        top_k=8,
        expert_d_ff=2048,
        shared_experts=1,
        dense_first=3,
        attn_params=7168 * 1536
        + 1536 * 128 * 192
        + 7168 * 576
        + 512 * 128 * 256
        + 128 * 128 * 7168,
        router_bias=True,
    ),
}
# Global batches: Llama 3 405B's final 16M tokens (2,048 x 8,192); DeepSeek-V3's 15,360 x 4,096.
BATCHES = {
    "llama3-8b": L.Batch(2048, 8192),
    "llama3-70b": L.Batch(2048, 8192),
    "llama3-405b": L.Batch(2048, 8192),
    "deepseek-v3": L.Batch(15360, 4096),
}
PUBLISHED = {
    "llama3-405b": (
        "16,384 H100: TP 8 x PP 16 x DP 128 (CP 16 for long context), 38-43% MFU, "
        "380-430 TFLOP/s per GPU (Meta, 2024)"
    ),
    "deepseek-v3": (
        "2,048 H800: PP 16 x EP 64 x ZeRO-1 DP, no TP, DualPipe (DeepSeek-V3 report, 2024)"
    ),
    "llama3-8b": "MaxText Llama2-7B on 8 x H100: about 50% MFU (shared/anchors)",
    "llama3-70b": "Megatron-Core: up to 47% MFU at scale (shared/anchors)",
}

# The published layouts, priced as the planner prices its own beside its picks. DeepSeek-V3's
# 61 layers do not split evenly over 16 stages (`L.Layout.uneven`: the 4-layer stages set the
# pace), and its micro-batch count is not published: 40 puts 3 sequences in one, 120 one. The
# report recomputes RMSNorm and MLA's up-projections and keeps FP8 activations, which the planner
# does not model: full recomputation stands in for them.
PUBLISHED_LAYOUTS = {
    "deepseek-v3": (
        2048,
        tuple(
            L.Layout(
                pp=16,
                ep=64,
                dp=2,
                schedule="dualpipe",
                microbatches=m,
                shard="zero1",
                recompute=recompute,
                uneven=True,
            )
            for m, recompute in ((40, "none"), (120, "none"), (120, "full"))
        ),
    ),
}

# --- this machine: what XLA:CPU keeps ----------------------------------------------------------

# What XLA:CPU keeps per token, and the planner's view of a config: the library's
# (jaxpipe.training.plan), which pipeline.auto_layout uses too.
CPU_ACTIVATIONS = plan.CPU_ACTIVATIONS
model_of, layout_of, predict = plan.model_of, plan.layout_of, plan.predict


@dataclasses.dataclass(frozen=True)
class Check:
  """One small layout: a config file and its overrides."""

  config: str  # configs/<name>.py
  overrides: tuple[tuple[str, object], ...] = ()  # (section.field, value)

  @property
  def label(self) -> str:
    return f"{self.config} " + " ".join(f"{k.split('.')[-1]}={v}" for k, v in self.overrides)


def _c(config: str, **over) -> Check:
  return Check(config, tuple((k.replace("__", "."), v) for k, v in over.items()))


CHECKS = (
    _c("tiny"),
    _c("tiny", pipeline__microbatches=2),
    _c("tiny", mesh__pp=2, pipeline__microbatches=2),
    _c("tiny", mesh__pp=2, pipeline__microbatches=4, data__batch=32),
    _c("tiny", mesh__pp=2, pipeline__microbatches=2, pipeline__schedule="gpipe"),
    _c("tiny", mesh__pp=2, pipeline__microbatches=2, pipeline__schedule="zb-h1"),
    _c("tiny", mesh__cp=2),
    _c("quickstart"),
    _c("quickstart", data__batch=8),
    _c("quickstart", data__batch=32),
    _c("quickstart", pipeline__microbatches=2),
    _c("quickstart", model__d_ff=768),
    _c("quickstart", data__seq_len=256),
    _c("quickstart", mesh__cp=2),
    _c("quickstart", mesh__cp=4, model__n_kv_heads=4),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=2),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=4),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=4, pipeline__schedule="gpipe"),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=4, pipeline__schedule="zb-h1"),
    _c("quickstart", mesh__pp=4, pipeline__microbatches=4, model__n_layers=8, data__batch=32),
    _c(
        "quickstart",
        mesh__pp=4,
        pipeline__microbatches=8,
        model__n_layers=8,
        data__batch=32,
        pipeline__schedule="interleaved-1f1b",
    ),
    _c("quickstart", mesh__pp=2, mesh__cp=2, pipeline__microbatches=2),
    _c("moe_quickstart"),
    _c("moe_quickstart", mesh__ep=2),
    _c("moe_quickstart", mesh__ep=8, data__batch=32),
    _c("moe_quickstart", mesh__ep=2, mesh__pp=2, pipeline__microbatches=2),
    # tensor parallelism, sequence parallelism, the distributed optimizer, recomputation
    _c("quickstart", mesh__tp=2),
    _c("quickstart", mesh__tp=2, model__sequence_parallel=True),
    _c("quickstart", mesh__tp=4, model__n_kv_heads=4),
    _c("quickstart", mesh__tp=2, mesh__pp=2, pipeline__microbatches=2),
    _c("quickstart", optimizer__shard="zero1"),
    _c("quickstart", optimizer__shard="zero2"),
    _c("quickstart", optimizer__shard="fsdp"),
    _c("quickstart", mesh__tp=2, optimizer__shard="zero1"),
    _c("quickstart", model__remat="selective"),
    _c("quickstart", model__remat=True),
    # what jaxpipe stores: the optimizer split beside cp (over dp x ep x cp), experts whole over
    # tp, zero2 in a pipeline holding whole gradients, fsdp there gathering one layer at a time
    _c("quickstart", mesh__cp=2, optimizer__shard="zero1"),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=2, optimizer__shard="zero2"),
    _c("quickstart", mesh__pp=2, pipeline__microbatches=2, optimizer__shard="fsdp"),
    _c("moe_quickstart", mesh__ep=2, mesh__tp=2),
    _c("moe_quickstart", mesh__ep=2, mesh__tp=2, model__sequence_parallel=True),
)


def load_config(check: Check):
  """The check's config: synthetic data, its overrides applied."""
  import importlib

  c = importlib.import_module(f"configs.{check.config}").get_config()
  c.data.source = "synthetic"
  if check.config != "tiny":
    c.mesh.ep = c.mesh.ep  # moe_quickstart's ep = 4 unless overridden
  for key, value in check.overrides:
    section, name = key.split(".")
    c[section][name] = value
  return c


def measured(config) -> dict:
  """`memory_analysis()` of the Trainer's compiled train step (lowered on shapes, nothing run):
  argument, output, alias, temp and total = argument + output - alias + temp."""
  import jax

  from jaxpipe.training.trainer import Trainer

  tr = Trainer(config)
  state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      tr.state_shapes,
      tr.state_sharding,
  )
  d = config.data
  host = tr.source.batch("train", 0, d.batch, d.seq_len)
  batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr._batch_sharding)
      for k, v in host.items()
  }
  mem = tr.build_train_step().lower(state, batch).compile().memory_analysis()
  out = {
      k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")
  }
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def check_one(check: Check) -> dict:
  """Prediction and measurement of one layout."""
  import jax

  from jaxpipe.training import config as config_lib

  config = load_config(check)
  shape = config_lib.validate(config, jax.device_count(), jax.default_backend())
  pred = predict(config, shape)
  t0 = time.perf_counter()
  got = measured(config)
  return {
      "label": check.label,
      "layout": layout_of(config, shape).label(),
      "predicted": pred.total,
      "measured": got["total"],
      "error": pred.total / got["total"] - 1,
      "compile_s": time.perf_counter() - t0,
      "memory": pred,
      "analysis": got,
  }


def check_table(rows: Sequence[dict]) -> str:
  lines = [
      "| layout | config | predicted MB | memory_analysis MB | error |",
      "| --- | --- | ---: | ---: | ---: |",
  ]
  for r in rows:
    lines.append(
        f"| {r['layout']} | {r['label']} | {r['predicted'] / 1e6:.2f} | "
        f"{r['measured'] / 1e6:.2f} | {100 * r['error']:+.1f}% |"
    )
  ok = sum(abs(r["error"]) <= 0.05 for r in rows)
  lines.append("")
  lines.append(f"{ok} of {len(rows)} layouts within 5%.")
  return "\n".join(lines)


# --- cluster tables ------------------------------------------------------------------------------


def cluster_table(name: str, devices: Sequence[int], top: int) -> str:
  model, batch = MODELS[name], BATCHES[name]
  lines = [
      f"**{model.name}** ({model.params / 1e9:.0f}B parameters, "
      f"{model.active_params / 1e9:.0f}B active; batch {batch.sequences} x {batch.seq_len}). "
      f"Published: {PUBLISHED[name]}.",
      "",
      "| H200s | layout | GB/device | step s | MFU | exposed comm s |",
      "| ---: | --- | ---: | ---: | ---: | --- |",
  ]
  for n in devices:
    plans = L.search(model, batch, L.h200(n))
    fitting = [p for p in plans if p.fits][:top]
    if not fitting:
      best = min(plans, key=lambda p: p.memory.total) if plans else None
      what = f"nothing fits (smallest {best.memory.total / 1e9:.0f} GB)" if best else "no layout"
      lines.append(f"| {n:,} | {what} | | | | |")
      continue
    for p in fitting:
      lines.append(_row(f"{n:,}", p, n))
  devices_published, layouts = PUBLISHED_LAYOUTS.get(name, (0, ()))
  for layout in layouts:
    cluster = L.h200(devices_published)
    mem = L.memory(model, layout, batch)
    plan = L.Plan(layout, mem, L.step_time(model, layout, batch, cluster), True)
    fits = mem.total <= (cluster.memory_gb - cluster.reserve_gb) * 1e9
    lines.append(_row(f"{devices_published:,} published", plan, devices_published, fits))
  return "\n".join(lines)


def _row(devices: str, p, n: int, fits: bool = True) -> str:
  comm = ", ".join(f"{k} {v:.2f}" for k, v in p.time.comm_s.items() if v > 0.005) or "-"
  gb = f"{p.memory.total / 1e9:.0f}" + ("" if fits else " (does not fit)")
  return (
      f"| {devices} | {p.layout.label()} | {gb} | {p.time.step_s:.2f} | "
      f"{100 * p.time.mfu(L.h200(n)):.0f}% | {comm} |"
  )


def _write(name: str, text: str) -> None:
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, name), "w") as f:
      f.write(text + "\n")


def main(argv: list[str]) -> int:
  cli.no_arguments(argv)
  if not (_CHECK.value or _TABLES.value):
    raise app.UsageError("give --check, --tables or both")
  for n in _MODELS.value:
    if n not in MODELS:
      raise app.UsageError(f"--models: unknown model {n!r}; known: {', '.join(MODELS)}")
  try:
    devices = [int(d) for d in _DEVICES.value]
  except ValueError:
    raise app.UsageError(f"--devices={','.join(_DEVICES.value)}: give integers") from None
  if _TABLES.value:
    text = "\n\n".join(cluster_table(n, devices, _TOP.value) for n in _MODELS.value)
    print(text)
    _write("tables.md", text)
  if _CHECK.value:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    checks = CHECKS[: _LAYOUTS.value] if _LAYOUTS.value else CHECKS
    rows = []
    for c in checks:
      r = check_one(c)
      rows.append(r)
      print(
          f"{r['layout']:<40} {r['predicted'] / 1e6:8.2f} MB predicted {r['measured'] / 1e6:8.2f}"
          f" MB measured {100 * r['error']:+6.1f}%  ({r['compile_s']:.0f} s)",
          flush=True,
      )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = f"{datetime.date.today().isoformat()}, load {load}\n\n" + check_table(rows)
    print(text)
    _write("check.md", text)
  return 0


if __name__ == "__main__":
  cli.run(main)
