"""Bytes a pipelined train step moves between pipeline ranks, per schedule, from the compiled step.

  python -m experiments.pipeline_traffic [--pp 4] [--microbatches 8] [--layers 8] [--d_model 256]

For each schedule, the Trainer's compiled step (the one `jaxpipe.train` runs) on a pp × dp mesh
of 8 host devices, counted from its HLO: the executor's ppermutes (activations and cotangents,
each run in the ticks of the scan where some rank receives over it, from the lowered table), the
ppermute that sums the gradients of a stage's two resident copies between their holders
(`sum_copies`; bidirectional schedules, Chimera and DualPipe, hold each stage on two ranks), and
every other collective-permute, which would be parameters or their gradients moving to the ranks
that run them. Bytes are per device and per step, set beside the layer stack a rank stores.
"""

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import re  # noqa: E402

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from jaxpipe.pipeline import SCHEDULE_NAMES  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("pp", 4, "Pipeline ranks.", flag_values=FLAGS)
flags.DEFINE_integer("microbatches", 8, "Micro-batches per step.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 8, "Model layers.", flag_values=FLAGS)
flags.DEFINE_integer("d_model", 256, "Model width (8 heads of d_model / 8).", flag_values=FLAGS)
flags.DEFINE_integer("batch", 16, "Sequences per step.", flag_values=FLAGS)
flags.DEFINE_integer("seq", 64, "Tokens per sequence.", flag_values=FLAGS)
flags.DEFINE_list("schedules", list(SCHEDULE_NAMES), "Schedules to compile.", flag_values=FLAGS)

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def _permutes(hlo: str) -> list[tuple[int, str]]:
  """(bytes, "ticks" | "copies" | "other") for each collective-permute of a compiled module:
  the executor's per-tick ppermute, the resident copies' gradient sum, anything else."""
  out = []
  for line in hlo.splitlines():
    if " collective-permute(" not in line:
      continue
    lhs = line.split(" collective-permute(")[0]
    size = sum(
        _BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", lhs)
    )
    name = re.search(r'op_name="([^"]*)"', line)
    name = name.group(1) if name else ""
    send = re.search(r"tick/send_(down|up)/", name)
    kind = (
        "copies" if "/sum_copies/ppermute" in name else f"send_{send.group(1)}" if send else "other"
    )
    out.append((size, kind))
  return out


def _tick_bytes(permutes: list[tuple[int, str]], table: np.ndarray) -> int:
  """Bytes the executor's ppermutes move in one step: each runs only in the ticks where some rank
  receives over it (a direction's activations and cotangents share one ppermute, or have one each).
  """
  from jaxpipe.pipeline.ir.lower import COL

  total = 0
  for direction in ("down", "up"):
    sizes = [b for b, kind in permutes if kind == f"send_{direction}"]
    if not sizes:
      continue
    recv = [table[:, :, COL[f"recv_{k}_{direction}"]] >= 0 for k in ("act", "grad")]
    if len(sizes) == 1:  # one ppermute carries both kinds
      total += sizes[0] * int(np.any(recv[0] | recv[1], axis=1).sum())
    else:
      assert len(sizes) == 2 and sizes[0] == sizes[1], sizes
      total += sizes[0] * sum(int(np.any(r, axis=1).sum()) for r in recv)
  return total


def measure(name: str, args) -> dict:
  import jax

  from configs import tiny
  from jaxpipe.training.mesh import batch_sharding
  from jaxpipe.training.pipeline_lm import lm_schedule
  from jaxpipe.training.trainer import Trainer

  c = tiny.get_config()
  c.model.update(
      n_layers=args.layers,
      d_model=args.d_model,
      d_ff=4 * args.d_model,
      n_heads=8,
      n_kv_heads=8,
      head_dim=args.d_model // 8,
  )
  c.data.update(batch=args.batch, seq_len=args.seq)
  c.mesh.pp, c.pipeline.schedule, c.pipeline.microbatches = args.pp, name, args.microbatches
  trainer = Trainer(c)
  state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      trainer.state_shapes,
      trainer.state_sharding,
  )
  batch = {
      k: jax.ShapeDtypeStruct(
          (args.batch, args.seq),
          np.int32 if k != "mask" else np.float32,
          sharding=batch_sharding(trainer.mesh),
      )
      for k in ("tokens", "targets", "mask")
  }
  hlo = trainer.build_train_step().lower(state, batch).compile().as_text()
  permutes = _permutes(hlo)
  ticks = lm_schedule(c.pipeline, args.pp)
  from jaxpipe.pipeline.api import lowered_for

  lowered = lowered_for(ticks)
  layer_bytes = sum(l.size * l.dtype.itemsize for l in jax.tree.leaves(state.params["layers"]))
  order = trainer.layer_order
  return {
      "schedule": name,
      "ticks": lowered.num_ticks,
      "activations": _tick_bytes(permutes, lowered.table),
      "copies": sum(b for b, kind in permutes if kind == "copies"),
      "parameters": sum(b for b, kind in permutes if kind == "other"),
      "stored": layer_bytes / args.pp,
      "stored_order": (
          "model order"
          if order is None
          else "rank by rank"
          if len(order) == len(set(order.tolist()))
          else "rank by rank, two copies"
      ),
  }


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  print(
      f"# bytes per device per step between pipeline ranks: pp = {args.pp}, "
      f"m = {args.microbatches}, {args.layers} layers of d_model {args.d_model}, batch "
      f"{args.batch} x {args.seq}, float32, 8 host devices"
  )
  print(
      "| schedule | ticks | activations + cotangents (ppermute) | copies' gradient sum | "
      "parameters + gradients moved (other collective-permutes) | layer stack stored per rank "
      "| layers stacked |"
  )
  print("|---|---|---|---|---|---|---|")
  mib = lambda b: f"{b / 2**20:.2f} MiB" if b else "0"
  for name in args.schedules:
    r = measure(name, args)
    print(
        f"| {name} | {r['ticks']} | {mib(r['activations'])} | {mib(r['copies'])} | "
        f"{mib(r['parameters'])} | {mib(r['stored'])} | {r['stored_order']} |",
        flush=True,
    )


if __name__ == "__main__":
  cli.run(main)
