"""serve_bench's seeded workload sent to an OpenAI-compatible server, timed from the stream.

  python -m jaxpipe.serve --config configs/quickstart.py --http --port 8000 --max_seq_len 192 \\
      --num_pages 193 --max_batch 32 --max_tokens_per_step 128 --token_buckets 8,32,128 \\
      --page_buckets 4,6,12           # serve_bench's engine, behind HTTP
  python -m experiments.serve_bench --url http://127.0.0.1:8000 [--compare] [--requests 64
      --rates 2,8,32 --prompt 8:96 --output 8:96 --seed 0]

As vLLM's serving benchmark does: every request is sent at its Poisson arrival time, streamed,
with its prompt as token ids, `max_tokens` its output length, greedy and `ignore_eos`; TTFT is
arrival to the first chunk carrying a token, TPOT (last token - first) / (tokens - 1), from the
times chunks arrive here; each request's `usage.completion_tokens` must equal its length. The
model comes from /v1/models, so the same command measures vLLM. Against a jaxpipe server the
KV column and the steps come from its /metrics (the same sums over steps serve_bench takes).

--compare (jaxpipe servers): builds the server's engine in this process (its settings and model
architecture from /v1/models, fresh weights: greedy decoding to fixed lengths does the same
work whatever the weights of a dense model) and runs each rate in-process with serve_bench's
driver, then over HTTP: the difference is the cost of the server, the HTTP stack and the client.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from experiments.serving import Done, Paged, parse_lengths, serve
from jaxpipe.serve.workload import Lengths, Work, generate

VOCAB = (
    256  # prompt tokens are uniform over the byte vocabulary (or a jaxpipe server's smaller one)
)
HEADER = (
    "| system | rate (req/s) | generated tok/s | TTFT p50 / p90 / p99 (ms) | "
    "TPOT p50 / p90 / p99 (ms) | KV in use / reserved | steps |\n|---|---|---|---|---|---|---|"
)
SERVER_METRICS = (
    "jaxpipe_kv_tokens_stored_total",
    "jaxpipe_kv_slots_held_total",
    "jaxpipe_engine_steps_total",
    "process_cpu_seconds_total",
)


def row(
    name: str,
    rate: float,
    done: list[Done],
    makespan: float,
    generated: int,
    kv: tuple[float, ...] | None,
) -> str:
  """One table row; kv: (tokens stored, slots held, steps, ...), summed over the run's steps."""
  pct = lambda xs, q: 1e3 * float(np.percentile(xs, q))
  ttft = [d.ttft for d in done]
  tpot = [d.tpot for d in done if d.tpot is not None]
  kv_cells = f"{100 * kv[0] / kv[1]:.1f}% | {kv[2]:.0f}" if kv and kv[1] else "n/a | n/a"
  return (
      f"| {name} | {rate:g} | {generated / makespan:,.0f} | "
      f"{pct(ttft, 50):,.0f} / {pct(ttft, 90):,.0f} / {pct(ttft, 99):,.0f} | "
      f"{pct(tpot, 50):,.1f} / {pct(tpot, 90):,.1f} / {pct(tpot, 99):,.1f} | {kv_cells} |"
  )


async def _request(client: httpx.AsyncClient, model: str, w: Work, t0: float) -> Done:
  arrival = t0 + w.arrival
  await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
  payload = {
      "model": model,
      "prompt": w.prompt,
      "max_tokens": w.max_tokens,
      "temperature": 0,
      "ignore_eos": True,
      "stream": True,
      "stream_options": {"include_usage": True},
  }
  times, usage = [], None
  async with client.stream("POST", "/v1/completions", json=payload) as r:
    if r.status_code != 200:
      raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      now, chunk = time.perf_counter(), json.loads(line[6:])
      if "error" in chunk:
        raise RuntimeError(f"the server failed the request: {chunk['error']}")
      for c in chunk["choices"]:  # a chunk's tokens: its token ids (jaxpipe's, even []), else
        # one if it has text (a server without token ids: vLLM streams a token a chunk)
        ids = c.get("token_ids")
        times += [now] * (len(ids) if ids is not None else 1 if c.get("text") else 0)
      usage = chunk.get("usage") or usage
  if usage is None or usage["completion_tokens"] != w.max_tokens or len(times) != w.max_tokens:
    raise RuntimeError(
        f"asked for {w.max_tokens} tokens, got {len(times)} chunks' worth and "
        f"usage {usage}; does the server honour ignore_eos?"
    )
  return Done(arrival, times)


async def _run(url: str, model: str, work: list[Work]) -> tuple[list[Done], float]:
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(_request(client, model, w, t0) for w in work))
  return list(done), time.perf_counter() - t0 - work[0].arrival


def _server_totals(url: str) -> tuple[float, ...] | None:
  values = {
      s.name: s.value
      for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
      for s in f.samples
  }
  return (
      tuple(values[k] for k in SERVER_METRICS) if all(k in values for k in SERVER_METRICS) else None
  )


def http_run(url: str, model: str, work: list[Work]) -> tuple[list[Done], float, tuple | None]:
  """(requests, makespan, and if the server reports them: KV sums, steps and its CPU seconds)."""
  before = _server_totals(url)
  done, makespan = asyncio.run(_run(url, model, work))
  after = _server_totals(url)
  return done, makespan, tuple(a - b for a, b in zip(after, before)) if before and after else None


def _twin(e: dict):
  """The server's engine (its /v1/models `engine`), built in this process with fresh weights."""
  import jax

  from jaxpipe.models import transformer
  from jaxpipe.serve.engine import Engine

  cfg = transformer.TransformerConfig(**e["model"])
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  engine = Engine(
      cfg,
      params,
      page_size=e["page_size"],
      num_pages=e["num_pages"],
      max_batch=e["max_batch"],
      max_tokens_per_step=e["max_tokens_per_step"],
      max_seq_len=e["max_seq_len"],
      token_buckets=e["token_buckets"],
      page_buckets=e["page_buckets"],
      attention=e["attention"],
  )
  engine.precompile()
  return engine


def check_context(prompt: Lengths, output: Lengths, max_model_len: int | None) -> None:
  """Refuses, in one line, a workload whose longest request does not fit the served context."""
  longest = sum(x.low if x.kind == "fixed" else x.high for x in (prompt, output))
  if isinstance(max_model_len, int) and longest > max_model_len:
    raise SystemExit(
        f"--prompt {prompt} + --output {output} reach {longest} tokens, past the server's "
        f"context of {max_model_len} (its max_model_len); give shorter --prompt/--output"
    )


def run(args) -> None:
  """`serve_bench --url`: its workload flags (`args`, serve_bench's flag values), plus --compare."""
  url = args.url.rstrip("/")
  try:
    (model,) = httpx.get(url + "/v1/models").json()["data"]
  except (httpx.HTTPError, ValueError, KeyError) as e:
    raise SystemExit(
        f"--url={args.url}: no OpenAI-compatible server answers /v1/models ({e})"
    ) from None
  prompt, output = parse_lengths(args)
  check_context(prompt, output, model.get("max_model_len"))
  print(
      f"# serve_bench over HTTP: {url}, model {model['id']!r}; {args.requests} requests per "
      f"rate, Poisson arrivals, prompt {prompt}, output {output} tokens, seed {args.seed}; "
      "greedy, ignore_eos, streamed"
  )
  if "engine" in model:
    print(f"# server engine: {json.dumps(model['engine'])}")
  engine = None
  if args.compare:
    if "model" not in model.get("engine", {}):
      raise SystemExit(
          "--compare needs a jaxpipe server (python -m jaxpipe.serve --http): "
          "its /v1/models describes the engine to build here"
      )
    if model["engine"].get("mode", "engine") != "engine":
      raise SystemExit(
          f"--compare builds one engine; the server runs a {model['engine']['mode']} "
          "deployment (compare deployments in-process with serve_bench --mode)"
      )
    engine = _twin(model["engine"])
  cpu_rows = []
  vocab = min(VOCAB, model.get("engine", {}).get("model", {}).get("vocab", VOCAB))
  print(HEADER)
  for rate in (float(r) for r in args.rates.split(",")):
    work = generate(args.requests, rate, prompt, output, vocab, args.seed)
    generated = sum(w.max_tokens for w in work)
    if engine is not None:
      paged, cpu = Paged(engine), time.process_time()
      makespan = serve(paged, work)
      cpu = time.process_time() - cpu
      tokens, slots = np.asarray(paged.usage, np.float64).sum(0)
      print(
          row(
              "in-process", rate, paged.done, makespan, generated, (tokens, slots, len(paged.usage))
          ),
          flush=True,
      )
    client_cpu = time.process_time()
    done, makespan, kv = http_run(url, model["id"], work)
    client_cpu = time.process_time() - client_cpu
    print(row("over HTTP", rate, done, makespan, generated, kv), flush=True)
    if engine is not None and kv:
      cpu_rows.append(
          f"| {rate:g} | {1e3 * cpu / generated:.2f} | {1e3 * kv[3] / generated:.2f} | "
          f"{1e3 * client_cpu / generated:.2f} |"
      )
  if cpu_rows:
    print(
        "\nCPU time per generated token (ms; all threads: XLA's and Python's):\n"
        "| rate (req/s) | in-process engine | server | HTTP client |\n|---|---|---|---|"
    )
    print("\n".join(cpu_rows))
