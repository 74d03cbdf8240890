"""Serving past one process, measured: one process, 1 prefill + 1 decode server behind a router,
and two replicas behind a router, on one workload and SLO; then the router's cache-aware rule
against least-loaded on chat sessions that share prefixes.

  python -m experiments.fleet_bench [--config configs/quickstart.py] [--requests 48
      --rates 2,4,8 --prompt 32:160 --output 16:64 --ttft_slo 0.5 --tpot_slo 0.05
      --sessions 8 --turns 6 --system 32 --user 16 --answer 24]

Every server is a process started as a user would (`python -m jaxpipe.serve --http`, `--role
prefill|decode|replica|router`), one CPU host device each, over loopback; all share this
machine's cores. The workload is serve_bench's (Poisson arrivals, prompts of random token ids,
greedy, `ignore_eos`), sent by `serve_client` at each rate: TTFT and TPOT percentiles from the
stream's chunk times, the share of requests within both SLOs (DistServe's attainment), and
goodput as the highest rate probed at which 90% met them, and the CPU seconds each process
spent (servers, then the router). The disaggregated row also reports
what its K/V moves cost: bytes and seconds per request (the decode server's pulls, pull to
admission) against the request's KV bytes.

The chat part: `--sessions` sessions of `--turns` turns run at once, each turn's prompt the
shared system prompt, the session's history (its earlier prompts and the answers) and a new user
message; its answer is appended. Two replicas behind a router, each routing rule in turn: the
replicas' prefix-cache hits (tokens) over the prompt tokens sent, generated tokens per second
and latency.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from absl import flags

from experiments import serve_client
from experiments.serving import parse_lengths
from jaxpipe.runtime import cli
from jaxpipe.serve import slo as slo_lib
from jaxpipe.serve.workload import generate

FLAGS = cli.flag_values(__name__)
flags.DEFINE_string(
    "config", "configs/quickstart.py", "The served model (fresh weights).", flag_values=FLAGS
)
flags.DEFINE_integer("requests", 48, "Requests per rate.", flag_values=FLAGS)
flags.DEFINE_list("rates", ["2", "4", "8"], "Request rates probed (per second).", flag_values=FLAGS)
flags.DEFINE_string(
    "prompt", "32:160", "Prompt tokens: N or LOW:HIGH (uniform).", flag_values=FLAGS
)
flags.DEFINE_string("output", "16:64", "Output tokens: N or LOW:HIGH (uniform).", flag_values=FLAGS)
flags.DEFINE_float("ttft_slo", 0.5, "TTFT target, seconds.", flag_values=FLAGS)
flags.DEFINE_float("tpot_slo", 0.05, "TPOT target, seconds.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "The workload's seed.", flag_values=FLAGS)
flags.DEFINE_integer(
    "sessions", 8, "Chat sessions at once (0: skip the chat part).", flag_values=FLAGS
)
flags.DEFINE_integer("turns", 6, "Turns per chat session.", flag_values=FLAGS)
flags.DEFINE_integer(
    "system", 32, "The system prompt's tokens, shared by every session.", flag_values=FLAGS
)
flags.DEFINE_integer("user", 16, "Tokens of each user message.", flag_values=FLAGS)
flags.DEFINE_integer("answer", 24, "Tokens of each answer.", flag_values=FLAGS)
flags.DEFINE_list(
    "parts", ["deployments", "chat"], "What to run: deployments, chat.", flag_values=FLAGS
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# serve_client's engine: a 192-token context, pages of 16, batch 32, 128 tokens a step
ENGINE = [
    "--max_seq_len", "320", "--num_pages", "321", "--max_batch", "32",
    "--max_tokens_per_step", "128", "--token_buckets", "8,32,128", "--page_buckets", "4,8,20",
]  # fmt: skip
SECRET = "fleet-bench"


def _port() -> int:
  with socket.create_server(("127.0.0.1", 0)) as s:
    return s.getsockname()[1]


class Processes:
  """Server processes of one deployment; stopped (SIGTERM, then SIGKILL) on exit."""

  def __init__(self, config: str):
    self.config, self.procs = config, []

  def start(self, *flags: str) -> str:
    port = _port()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "JAXPIPE_HOST_DEVICES": "1",
        "JAXPIPE_FLEET_SECRET": SECRET,
    }
    cmd = [sys.executable, "-m", "jaxpipe.serve", "--config", self.config, *ENGINE, *flags]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    self.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
      if proc.poll() is not None:
        raise SystemExit(f"{' '.join(flags)} exited: {proc.stderr.read()[-2000:]}")
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          return url
      except httpx.TransportError:
        pass
      if time.monotonic() > deadline:
        raise SystemExit(f"{' '.join(flags)} did not come up in 600 s")
      time.sleep(0.3)

  def cpu_seconds(self) -> list[float]:
    """Each process' user + system CPU seconds so far (Linux /proc), in start order."""
    out = []
    for p in self.procs:
      with open(f"/proc/{p.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out

  def __enter__(self) -> Processes:
    return self

  def __exit__(self, *exc) -> None:
    for p in self.procs:
      p.send_signal(signal.SIGTERM)
    for p in self.procs:
      try:
        p.wait(60)
      except subprocess.TimeoutExpired:
        p.kill()


def _fleet_load(url: str) -> dict:
  return httpx.get(url + "/fleet/load", headers={"Authorization": f"Bearer {SECRET}"}).json()


def _deployments(args) -> None:
  prompt, output = parse_lengths(args)
  rates = [float(r) for r in args.rates]
  target = slo_lib.SLO(args.ttft_slo, args.tpot_slo)
  print(
      f"## Deployments: {args.requests} requests a rate, prompts {prompt}, outputs {output}; SLO "
      f"TTFT {1e3 * target.ttft:g} ms, TPOT {1e3 * target.tpot:g} ms\n"
  )
  print(
      "| deployment | rate (req/s) | generated tok/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
      "| within SLO | CPU s: servers / router | K/V moved per request |\n"
      "|---|---|---|---|---|---|---|---|"
  )
  for name in ("one process", "1 prefill + 1 decode, router", "2 replicas, router"):
    with Processes(args.config) as ps:
      decode = None
      if name == "one process":
        url = ps.start("--http")
      elif name.startswith("1 prefill"):
        p, decode = ps.start("--role", "prefill"), ps.start("--role", "decode")
        url = ps.start("--role", "router", "--prefill_urls", p, "--decode_urls", decode)
      else:
        r0, r1 = ps.start("--role", "replica"), ps.start("--role", "replica")
        url = ps.start("--role", "router", "--replica_urls", f"{r0},{r1}")
      model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
      warm = generate(4, 100.0, prompt, output, serve_client.VOCAB, args.seed + 1)
      serve_client.http_run(url, model, warm)
      good = 0.0
      for rate in rates:
        work = generate(args.requests, rate, prompt, output, serve_client.VOCAB, args.seed)
        before = _fleet_load(decode)["moved"] if decode else None
        cpu0 = ps.cpu_seconds()
        done, makespan, _ = serve_client.http_run(url, model, work)
        cpu = [b - a for a, b in zip(cpu0, ps.cpu_seconds())]
        cpu = (
            f"{cpu[0]:.1f}"
            if len(cpu) == 1
            else f"{' + '.join(f'{c:.1f}' for c in cpu[:-1])} / {cpu[-1]:.1f}"
        )
        met = slo_lib.attainment(done, target)
        good = rate if met >= target.attainment else good
        moved = "—"
        if decode:
          after = _fleet_load(decode)["moved"]
          n = after["pulls"] - before["pulls"]
          nbytes, secs = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
          tokens = sum(len(w.prompt) for w in work)
          moved = (
              f"{nbytes / n / 2**20:.2f} MiB ({nbytes / tokens / 2**10:.1f} KiB a prompt token) "
              f"in {1e3 * secs / n:.1f} ms, {nbytes / secs / 1e9:.2f} GB/s"
          )
        ttft = slo_lib.percentiles([d.ttft for d in done], (50, 90))
        tpot = slo_lib.percentiles([d.tpot for d in done], (50, 90))
        generated = sum(len(d.token_times) for d in done)
        print(
            f"| {name} | {rate:g} | {generated / makespan:,.0f} | "
            f"{1e3 * ttft[0]:,.0f} / {1e3 * ttft[1]:,.0f} | "
            f"{1e3 * tpot[0]:,.1f} / {1e3 * tpot[1]:,.1f} | {100 * met:.0f}% | {cpu} | {moved} |",
            flush=True,
        )
      print(f"| {name}: goodput | ≥ {good:g} req/s of those probed | | | | | | |", flush=True)


async def _session(client, model: str, rng, args, system: list[int], stats: dict) -> None:
  history = list(system)
  for _ in range(args.turns):
    history += list(map(int, rng.integers(0, serve_client.VOCAB, args.user)))
    body = {
        "model": model,
        "prompt": history,
        "max_tokens": args.answer,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    got = await client.post("/v1/completions", json=body)
    got.raise_for_status()
    stats["latency"].append(time.perf_counter() - start)
    stats["prompt"] += len(history)
    answer = got.json()["choices"][0]["token_ids"]
    stats["generated"] += len(answer)
    history += answer


def _chat(args) -> None:
  print(
      f"\n## Chat sessions over 2 replicas: {args.sessions} sessions x {args.turns} turns, "
      f"system prompt {args.system} tokens, user messages {args.user}, answers {args.answer}\n"
  )
  print(
      "| routing | prefix-cache hits / prompt tokens | generated tok/s | latency p50 / p90 (ms) "
      "| tokens computed per replica |\n|---|---|---|---|---|"
  )
  rng0 = np.random.default_rng(args.seed)
  system = list(map(int, rng0.integers(0, serve_client.VOCAB, args.system)))
  for policy in ("cache_aware", "least_loaded"):
    with Processes(args.config) as ps:
      replicas = [ps.start("--role", "replica"), ps.start("--role", "replica")]
      url = ps.start("--role", "router", "--replica_urls", ",".join(replicas), "--routing", policy)
      model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
      hits0 = sum(_fleet_load(r)["counts"].get("prefix_hits", 0) for r in replicas)
      runs0 = [_fleet_load(r)["counts"].get("step_tokens", 0) for r in replicas]
      stats = {"latency": [], "prompt": 0, "generated": 0}

      async def run():
        async with httpx.AsyncClient(base_url=url, timeout=None) as client:
          rngs = [np.random.default_rng(args.seed + 1 + i) for i in range(args.sessions)]
          await asyncio.gather(*(_session(client, model, g, args, system, stats) for g in rngs))

      start = time.perf_counter()
      asyncio.run(run())
      makespan = time.perf_counter() - start
      loads = [_fleet_load(r) for r in replicas]
      hits = sum(l["counts"].get("prefix_hits", 0) for l in loads) - hits0
      work = [l["counts"].get("step_tokens", 0) - b for l, b in zip(loads, runs0)]
      lat = slo_lib.percentiles(stats["latency"], (50, 90))
      print(
          f"| {policy} | {hits:,} / {stats['prompt']:,} ({100 * hits / stats['prompt']:.0f}%) | "
          f"{stats['generated'] / makespan:,.0f} | {1e3 * lat[0]:,.0f} / {1e3 * lat[1]:,.0f} | "
          f"{work[0]:,} / {work[1]:,} |",
          flush=True,
      )


def main(argv) -> None:
  """Runs the parts (module docstring) and prints their tables.

  Args:
    argv: the program name.
  """
  del argv
  args = FLAGS
  print(
      f"# fleet_bench {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load "
      f"{os.getloadavg()[0]:.2f}; {args.config}, fresh weights, float32\n"
  )
  if "deployments" in args.parts:
    _deployments(args)
  if "chat" in args.parts and args.sessions:
    _chat(args)


if __name__ == "__main__":
  cli.run(main)
