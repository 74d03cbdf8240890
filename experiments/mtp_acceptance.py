"""DeepSeek-V3's multi-token prediction module as a drafter, trained: the quickstart model trained
with one MTP module, then served plain, with MTP drafts and with n-gram drafts, on text it never
read.

  python -m experiments.mtp_acceptance [--workdir /tmp/jaxpipe_mtp --steps 300 --requests 16
      --prompt 128 --output 64 --k 1,2,3 --rounds 3 --temperature 0]

Training is the README's main job with one MTP module (`python -m jaxpipe.train --config
configs/quickstart.py --config.model.mtp_depth=1`: a byte-level Llama on the Python standard
library's source), run as a subprocess unless the workdir already holds its checkpoint.
Serving: each prompt is a window of the evaluation split (the corpus's tail, which training
never reads), greedy or sampled (`--temperature`), EOS ignored, float32, one engine per
contender over the same weights, in alternated rounds:

- `plain`: the engine as served (async scheduling); `plain sync`: without it, as a speculating
  engine runs;
- `mtp k=K`: the module's drafts, up to K a step (`serve.mtp_drafter`);
- `ngram k=K`: prompt-lookup drafts for the largest K (`serve.speculative`).

Per contender: tokens/s per round, the median, the ratio to `plain` in the same round, steps,
drafts kept, and (greedy) how many requests' tokens equal plain's: all of them, as greedy
speculation keeps the plain engine's tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
from absl import flags

from experiments.decode_features import Work, table
from experiments.serve_dtype import pool_engine as engine
from experiments.serve_dtype import serve_round
from jaxpipe.runtime import cli
from jaxpipe.serve.sampling import SamplingParams
from jaxpipe.serve.speculative import SpecConfig
from jaxpipe.training import batches, restore
from jaxpipe.training import config as config_lib

FLAGS = cli.flag_values(__name__)
flags.DEFINE_string("workdir", "/tmp/jaxpipe_mtp", "The training run's workdir.", flag_values=FLAGS)
flags.DEFINE_integer("steps", 300, "Training steps (the quickstart's).", flag_values=FLAGS)
flags.DEFINE_integer("requests", 16, "Requests, all arriving at once.", flag_values=FLAGS)
flags.DEFINE_integer("prompt", 128, "Prompt bytes.", flag_values=FLAGS)
flags.DEFINE_integer("output", 64, "Output bytes.", flag_values=FLAGS)
flags.DEFINE_list("k", ["1", "2", "3"], "Drafts per step of each MTP contender.", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "Timed rounds of each contender.", flag_values=FLAGS)
flags.DEFINE_integer("max_batch", 16, "Requests running at once.", flag_values=FLAGS)
flags.DEFINE_integer("token_budget", 512, "Tokens per step.", flag_values=FLAGS)
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the prompts' offsets.", flag_values=FLAGS)
flags.DEFINE_float(
    "temperature",
    0.0,
    "Sampling temperature (0: greedy); request i samples with seed i.",
    flag_values=FLAGS,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def train(workdir: str, steps: int) -> None:
  """The quickstart run with one MTP module into `workdir` (resumed, or skipped when done)."""
  cmd = [
      sys.executable,
      "-m",
      "jaxpipe.train",
      "--config",
      "configs/quickstart.py",
      "--config.model.mtp_depth=1",
      f"--config.train.steps={steps}",
      "--workdir",
      workdir,
  ]
  print("# training:", " ".join(cmd[1:]), flush=True)
  subprocess.run(cmd, cwd=ROOT, check=True)


def workload(config, args) -> list[Work]:
  """Windows of the evaluation split as prompts (whole bytes: the model's tokens)."""
  data = config.data
  held_out = batches.ByteCorpus(batches.stdlib_bytes(), data.eval_fraction, data.seed)
  text = held_out.splits["eval"]
  rng = np.random.default_rng(args.seed)
  starts = rng.integers(0, len(text) - args.prompt, args.requests)
  return [Work(text[s : s + args.prompt].astype(int).tolist(), args.output) for s in starts]


def main(argv) -> None:
  del argv
  args = FLAGS
  train(args.workdir, args.steps)
  config = restore.run_config(args.workdir)
  step, params = restore.restore_params(args.workdir, config)
  cfg = config_lib.model_config(config)
  work = workload(config, args)
  ks = sorted(int(k) for k in args.k)
  contenders = {
      "plain": engine(cfg, params, work, args),
      "plain sync": engine(cfg, params, work, args, async_scheduling=False),
  }
  for k in ks:
    contenders[f"mtp k={k}"] = engine(
        cfg, params, work, args, speculative=SpecConfig("mtp", num_tokens=k)
    )
  contenders[f"ngram k={ks[-1]}"] = engine(
      cfg, params, work, args, speculative=SpecConfig(num_tokens=ks[-1])
  )
  samplings = [SamplingParams(temperature=args.temperature, seed=i) for i in range(len(work))]
  load0 = os.getloadavg()[0]
  for e in contenders.values():
    serve_round(e, work, samplings)  # warm-up: compiles every program the round uses
  names = list(contenders)
  rounds = {n: [] for n in names}
  for r in range(args.rounds):
    for n in names[r % len(names) :] + names[: r % len(names)]:
      rounds[n].append(serve_round(contenders[n], work, samplings))
  print(
      f"# {args.workdir} at step {step}: byte-level Llama d_model {cfg.d_model}, "
      f"{cfg.n_layers} layers, one MTP module, float32; {len(work)} requests of {args.prompt} "
      f"held-out bytes, {args.output} out, "
      f"{f'temperature {args.temperature:g}' if args.temperature else 'greedy'}; batch "
      f"{args.max_batch}; {os.cpu_count()} "
      f"cores ({jax.devices()[0].device_kind}); {args.rounds} rounds, load {load0:.1f} -> "
      f"{os.getloadavg()[0]:.1f}"
  )
  print(table(rounds, len(work), sampled=bool(args.temperature)))


if __name__ == "__main__":
  cli.run(main)
