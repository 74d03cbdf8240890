"""Speculative decoding and structured output against the plain engine: tokens/s, acceptance and
steps on one workload, alternated in rounds.

  python -m experiments.decode_features [--shape toy|smollm2-135m] [--requests 32
      --prompt 64:192 --output 64 --rounds 3 --max_batch 32 --token_budget 512 --repeat 16]

Contenders, one engine each over the same random weights of a Llama of the given shape
(`experiments.serve_dtype`'s shapes), float32, greedy, EOS ignored:

- `plain`: the engine as served (async scheduling);
- `plain sync`: without async scheduling, which a speculating engine gives up;
- `ngram k=4`: prompt-lookup drafts, up to 4 a step (`serve.speculative`);
- `mtp k=2`: drafts from the model's own multi-token prediction module (DeepSeek-V3's, one
  module, random like the rest: what running it costs, `serve.mtp_drafter`);
- `grammar half` / `grammar all`: half or all of the requests constrained by a regex grammar
  over byte tokens (`[a-z]+( [a-z]+)*`; ids past 255 are special), compiled by llguidance for
  the model's whole vocabulary: the token masks' cost, filled while the step's model runs
  (`serve.grammar`).

Prompts are random segments of `--repeat` tokens repeated to their length (text that repeats
itself, as code and edited documents do, is where prompt lookup finds drafts); with random
weights the acceptance says how often the model continues a repetition, not what a trained
model's would be. Per contender: tokens/s per round, the median, the ratio to `plain` in the
same round, steps per round, drafts kept, and how many requests' tokens equal plain's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import jax
import numpy as np
from absl import flags

from experiments.serve_dtype import pool_engine as engine
from experiments.serve_dtype import serve_round
from experiments.serve_peer import agreement, round_figures
from experiments.shapes import SHAPES
from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.models import transformer
from jaxpipe.runtime import cli
from jaxpipe.serve import grammar
from jaxpipe.serve.sampling import SamplingParams
from jaxpipe.serve.speculative import SpecConfig
from jaxpipe.serve.workload import Lengths

FLAGS = cli.flag_values(__name__)
flags.DEFINE_enum("shape", "toy", list(SHAPES), "The Llama's shape.", flag_values=FLAGS)
flags.DEFINE_integer("requests", 32, "Requests, all arriving at once.", flag_values=FLAGS)
flags.DEFINE_string("prompt", "64:192", "Prompt lengths, uniform in LO:HI.", flag_values=FLAGS)
flags.DEFINE_string("output", "64", "Output lengths, uniform in LO:HI.", flag_values=FLAGS)
flags.DEFINE_integer("repeat", 16, "Tokens of the segment each prompt repeats.", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "Timed rounds of each contender.", flag_values=FLAGS)
flags.DEFINE_integer("max_batch", 32, "Requests running at once.", flag_values=FLAGS)
flags.DEFINE_integer("token_budget", 512, "Tokens per step.", flag_values=FLAGS)
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the workload and the weights.", flag_values=FLAGS)
PATTERN = "[a-z]+( [a-z]+)*"


@dataclasses.dataclass
class Work:
  prompt: list[int]
  max_tokens: int


def workload(args, vocab: int) -> list[Work]:
  """Prompts that repeat a random segment to their length."""
  rng = np.random.default_rng(args.seed)
  prompts, outputs = Lengths.parse(args.prompt), Lengths.parse(args.output)
  work = []
  for _ in range(args.requests):
    segment = rng.integers(0, vocab, args.repeat).tolist()
    n = prompts.sample(rng)
    work.append(Work((segment * (n // args.repeat + 1))[:n], outputs.sample(rng)))
  return work


def main(argv) -> None:
  del argv
  args = FLAGS
  cfg = dataclasses.replace(SHAPES[args.shape], mtp_depth=1)  # the others leave it unused
  params = transformer.init_params(cfg, jax.random.key(args.seed))
  work = workload(args, cfg.vocab)
  guide = grammar.Compiler(tokenizer_lib.ByteTokenizer(), cfg.vocab, []).compile("regex", PATTERN)
  plain, constrained = SamplingParams(), SamplingParams(guide=guide)
  contenders = {
      "plain": (engine(cfg, params, work, args), [plain] * len(work)),
      "plain sync": (engine(cfg, params, work, args, async_scheduling=False), [plain] * len(work)),
      "ngram k=4": (
          engine(cfg, params, work, args, speculative=SpecConfig(num_tokens=4)),
          [plain] * len(work),
      ),
      "mtp k=2": (
          engine(cfg, params, work, args, speculative=SpecConfig("mtp", num_tokens=2)),
          [plain] * len(work),
      ),
      "grammar half": (
          engine(cfg, params, work, args),
          [constrained if i % 2 else plain for i in range(len(work))],
      ),
      "grammar all": (engine(cfg, params, work, args), [constrained] * len(work)),
  }
  load0 = os.getloadavg()[0]
  for e, samplings in contenders.values():
    serve_round(e, work, samplings)  # warm-up: compiles every program the round uses
  names = list(contenders)
  rounds = {n: [] for n in names}
  for r in range(args.rounds):
    for n in names[r % len(names) :] + names[: r % len(names)]:
      rounds[n].append(serve_round(contenders[n][0], work, contenders[n][1]))
  prompts = [len(w.prompt) for w in work]
  print(
      f"# {args.shape} Llama, float32 (random weights); {len(work)} requests, prompts "
      f"{min(prompts)}-{max(prompts)} repeating {args.repeat}-token segments, {args.output} "
      f"tokens out, greedy; batch {args.max_batch}, {args.token_budget} tokens per step; "
      f"{os.cpu_count()} cores ({jax.devices()[0].device_kind}); {args.rounds} rounds, load "
      f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"
  )
  print(table(rounds, len(work)))


def table(rounds: dict[str, list[dict]], requests: int, sampled: bool = False) -> str:
  """The contenders' rounds as a Markdown table, each against the first (`plain`).

  Args:
    rounds: each contender's `serve_round` results, the baseline first.
    requests: requests per round.
    sampled: the rounds sampled (their tokens are other draws than the baseline's: not compared).

  Returns:
    The table: tokens/s per round, median, ratio to the baseline per round, steps, drafts kept,
    how many requests' tokens equal the baseline's.
  """
  tps = {n: [round_figures(x["times"])["tokens_per_s"] for x in rs] for n, rs in rounds.items()}
  base = next(iter(rounds))
  lines = [
      "| contender | tokens/s (rounds) | median | vs plain | steps | drafts kept | "
      "tokens = plain's |",
      "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for n, rs in rounds.items():
    ratio = [a / b for a, b in zip(tps[n], tps[base])]
    last = rs[-1]
    same, _ = agreement(last["tokens"], rounds[base][-1]["tokens"])
    kept = "-"
    if last["drafts"]:
      kept = f"{last['kept']} of {last['drafts']} ({last['kept'] / last['drafts']:.0%})"
    lines.append(
        f"| {n} | "
        + ", ".join(f"{x:,.0f}" for x in tps[n])
        + f" | {statistics.median(tps[n]):,.0f} | "
        + ", ".join(f"{x:.2f}x" for x in ratio)
        + f" | {last['steps']} | {kept} | {'-' if sampled else f'{same}/{requests}'} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  cli.run(main)
