"""Serving in bfloat16 against float32: the engine's tokens/s, weights and KV bytes, one workload.

  python -m experiments.serve_dtype [--shape toy|smollm2-135m] [--requests 64 --prompt 32:256
      --output 64 --rounds 3 --max_batch 64 --token_budget 1024 --page_size 16]

`python -m jaxpipe.serve --dtype bfloat16` casts the weights once, at load, and computes in
bfloat16 (`jaxpipe.serve.__main__.in_dtype`); with `--kv_cache_dtype auto` the KV pages are
bfloat16 too, which the CPU kernel (`cpu_ragged`) reads. This bench builds one engine per dtype
on the same random weights of a Llama of the given shape (toy: the serving bench's, hidden 256,
4 layers, vocabulary 1,024; smollm2-135m: 30 layers, hidden 576, 9/3 heads, d_ff 1,536,
vocabulary 49,152, tied embeddings), compiles its step programs (a decode batch's and a prefill
chunk's token count, tables padded to the longest sequence), serves the same seeded requests
(all arriving at once, greedy, EOS ignored) in alternating rounds after a warm-up round each,
and prints per dtype:
tokens/s per round and their median, the ratio to float32 in the same round, the weights' and
pools' bytes, and how many requests' greedy tokens equal float32's.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
from absl import flags

from experiments.serve_peer import agreement, round_figures, workload
from experiments.shapes import SHAPES
from jaxpipe.models import transformer
from jaxpipe.runtime import cli
from jaxpipe.serve import __main__ as serve_main
from jaxpipe.serve.engine import Engine

FLAGS = cli.flag_values(__name__)
DTYPES = ("float32", "bfloat16")
flags.DEFINE_enum("shape", "toy", list(SHAPES), "The Llama's shape.", flag_values=FLAGS)
flags.DEFINE_integer("requests", 64, "Requests, all arriving at once.", flag_values=FLAGS)
flags.DEFINE_string("prompt", "32:256", "Prompt lengths, uniform in LO:HI.", flag_values=FLAGS)
flags.DEFINE_string("output", "64", "Output lengths, uniform in LO:HI.", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "Timed rounds of each dtype, alternating.", flag_values=FLAGS)
flags.DEFINE_integer("max_batch", 64, "Requests running at once.", flag_values=FLAGS)
flags.DEFINE_integer("token_budget", 1024, "Tokens per step.", flag_values=FLAGS)
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the workload and the weights.", flag_values=FLAGS)


def engine(cfg, params, dtype: str, work, args) -> Engine:
  """An engine holding the weights in `dtype` (serve --dtype) over pools for the workload."""
  cfg, params = serve_main.in_dtype(cfg, params, dtype)
  # few programs, all compiled before the clock starts: decode batches and prefill chunks
  return pool_engine(cfg, params, work, args, token_buckets=(args.max_batch, args.token_budget))


def pool_engine(cfg, params, work, args, **fields) -> Engine:
  """An engine whose pools hold every request of the workload at once (no prefix cache, every
  sequence's table padded to the longest); `fields` add to or replace its `EngineConfig`."""
  s = args.page_size
  length = -(-max(len(w.prompt) + w.max_tokens for w in work) // s) * s
  settings = dict(
      page_size=s,
      num_pages=args.max_batch * (length // s) + 1,
      max_batch=args.max_batch,
      max_tokens_per_step=args.token_budget,
      max_seq_len=length,
      prefix_caching=False,
      page_buckets=(length // s,),
  )
  return Engine(cfg, params, **(settings | fields))


def serve_round(e: Engine, work, samplings=None) -> dict:
  """The workload once (greedy, or each request's `samplings`) -> its tokens, each request's
  token times, the steps, and the drafts proposed and kept (speculative decoding)."""
  t0, steps, counts = time.perf_counter(), e.steps, dict(e.counts)
  samplings = samplings or [None] * len(work)
  ids = [e.add_request(w.prompt, w.max_tokens, sp, eos_id=None) for w, sp in zip(work, samplings)]
  while e.has_work():
    e.step()
  done = {r.id: r for r in e.finished()}
  return {
      "tokens": [done[i].output for i in ids],
      "times": [[t - t0 for t in done[i].token_times] for i in ids],
      "steps": e.steps - steps,
      "drafts": e.counts["spec_drafts"] - counts.get("spec_drafts", 0),
      "kept": e.counts["spec_accepted"] - counts.get("spec_accepted", 0),
  }


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def main(argv) -> None:
  del argv
  args = FLAGS
  cfg = SHAPES[args.shape]
  params = transformer.init_params(cfg, jax.random.key(args.seed))
  work = workload(args, cfg.vocab)
  engines = {d: engine(cfg, params, d, work, args) for d in DTYPES}
  load0 = os.getloadavg()[0]
  for e in engines.values():
    e.precompile()
    serve_round(e, work)  # a warm-up round
  rounds = {d: [] for d in DTYPES}
  for r in range(args.rounds):
    for d in DTYPES[r % 2 :] + DTYPES[: r % 2]:
      rounds[d].append(serve_round(engines[d], work))
  tps = {d: [round_figures(x["times"])["tokens_per_s"] for x in rs] for d, rs in rounds.items()}
  prompts = [len(w.prompt) for w in work]
  print(
      f"# {args.shape} Llama; {len(work)} requests, prompts {min(prompts)}-{max(prompts)}, "
      f"{args.output} tokens out, greedy; batch {args.max_batch}, {args.token_budget} tokens per "
      f"step; {os.cpu_count()} cores ({jax.devices()[0].device_kind}); {args.rounds} rounds, "
      f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}"
  )
  print(
      "| dtype | attention | weights (MiB) | KV pools (MiB) | tokens/s (rounds) | median "
      "| vs float32 | greedy = float32 |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for d, e in engines.items():
    ratio = [a / b for a, b in zip(tps[d], tps["float32"])]
    same, _ = agreement(rounds[d][-1]["tokens"], rounds["float32"][-1]["tokens"])
    print(
        f"| {d} | {e.backend} | {nbytes(e.params) / 2**20:,.1f} | "
        f"{(e.kv.k.nbytes + e.kv.v.nbytes) / 2**20:,.1f} | "
        + ", ".join(f"{x:,.0f}" for x in tps[d])
        + f" | {statistics.median(tps[d]):,.0f} | "
        + ", ".join(f"{x:.2f}x" for x in ratio)
        + f" | {same}/{len(work)} |"
    )


if __name__ == "__main__":
  cli.run(main)
