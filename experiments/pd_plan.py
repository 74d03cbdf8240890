"""Prefill/decode planning: the P:D split and batch that maximise goodput under SLOs.

  python -m experiments.pd_plan                  # cluster scale, simulated: Llama-3-8B and 70B
                                                 # shapes on 8-64 H200s, costs from a roofline
  python -m experiments.pd_plan --cpu            # this machine: profile, plan, predict ...
  python -m experiments.pd_plan --cpu --measure  # ... and run the deployments beside it

The cost model is what a step computes: `jaxpipe.serve.sim.Roofline` (FLOPs and bytes of the
model on tp GPUs at H200 peak: 989 TFLOP/s dense bf16, 4.8 TB/s HBM, tensor-parallel all-reduces
over NVLink at 450 GB/s a direction) or, with --cpu, `StepTable`: the engine's compiled step
programs timed one by one on one host device, plus host time per step and per sequence fitted
from a run of the engine alone. The K/V copy costs pages * page_size * KV bytes per token /
bandwidth + latency. `jaxpipe.serve.sim.simulate` serves a seeded workload on that cost model,
scheduling as the engine does; goodput is searched over rates on it (`slo.search_goodput`).

Cluster scale (DistServe's placement, simplified): every worker kind is simulated alone, with the
other phase free (a prefill worker against TTFT, a decode worker against TPOT, a colocated one
against both; 95% of requests each, so that both hold for about 90%), which gives its goodput
per instance; a cluster of N GPUs takes the counts of each kind that maximise min(prefill
goodput, decode goodput) within N, and the best few are then simulated whole, routing included,
as far as --max_sim_gpus (larger clusters are the per-instance figure replicated; the simulated
whole at the sizes where both exist says how far that holds). KV copies cross nodes: one 400
Gb/s InfiniBand NIC per GPU, 50 GB/s, times min(tp of P, tp of D) NICs in parallel, 50 us each;
within a node NVLink would give 9x that, which matters little here: a copy is a few percent of a
prefill (printed). Colocated workers are run two ways: the engine's scheduler (decode first,
chunked prefill under a token budget, as vLLM and Sarathi-Serve now do) and prefill-first whole
prompts (vLLM's first scheduler, DistServe's baseline).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
from absl import app, flags

from jaxpipe.runtime import cli
from jaxpipe.serve import sim
from jaxpipe.serve.slo import SLO, attainment, search_goodput, summary
from jaxpipe.serve.workload import Lengths, generate

NIC_BW = 50e9  # bytes/s: one 400 Gb/s InfiniBand NDR NIC per GPU
NIC_LATENCY = 50e-6  # seconds per copy

FLAGS = cli.flag_values(__name__)
flags.DEFINE_bool("cpu", False, "Plan for this machine's host devices.", flag_values=FLAGS)
flags.DEFINE_bool(
    "measure",
    False,
    "--cpu: run the deployments too and print them beside the prediction.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "bench_args",
    "--mode both --rates 4,16",
    "--cpu: serve_bench flags of the deployments to predict (and measure).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("repeats", 5, "--cpu: timed runs per step program.", flag_values=FLAGS)
flags.DEFINE_float(
    "cores",
    2,
    "--cpu: cores the host devices share (the lock-step clock packs the "
    "steps); on a loaded host, the share of them this process gets.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "transfer_bw",
    math.inf,
    "--cpu: bytes/s of a K/V move between prefill and decode workers; inf: workers of one "
    "process (a host copy). Between server processes (--role prefill|decode) give what "
    "`experiments.kv_wire_bench` fits over loopback.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "transfer_latency", 0.0, "--cpu: seconds per K/V move besides its bytes.", flag_values=FLAGS
)
flags.DEFINE_string("models", "8b,70b", "Models to plan for: 8b, 70b.", flag_values=FLAGS)
flags.DEFINE_string("gpus", "8,16,32,64", "Cluster sizes.", flag_values=FLAGS)
flags.DEFINE_string(
    "prompt", "lognormal:512:4096", "Prompt lengths (as serve_bench's).", flag_values=FLAGS
)
flags.DEFINE_string(
    "output", "lognormal:128:1024", "Output lengths (as serve_bench's).", flag_values=FLAGS
)
flags.DEFINE_integer("requests", 400, "Fewest requests per simulated probe.", flag_values=FLAGS)
flags.DEFINE_float(
    "horizon", 15.0, "Seconds of arrivals at least per simulated probe.", flag_values=FLAGS
)
flags.DEFINE_integer("seed", 0, "Seed of the workload.", flag_values=FLAGS)
flags.DEFINE_list("slo_8b", ["0.2", "0.02"], "TTFT,TPOT seconds for Llama-3-8B.", flag_values=FLAGS)
flags.DEFINE_list(
    "slo_70b", ["0.5", "0.05"], "TTFT,TPOT seconds for Llama-3-70B.", flag_values=FLAGS
)
flags.DEFINE_string("batches", "128,256", "Most sequences per step to try.", flag_values=FLAGS)
flags.DEFINE_string("budgets", "512,2048", "Colocated tokens per step to try.", flag_values=FLAGS)
flags.DEFINE_integer("probes", 9, "Rates probed per goodput search.", flag_values=FLAGS)
flags.DEFINE_integer("top", 3, "Best splits simulated whole.", flag_values=FLAGS)
flags.DEFINE_integer(
    "max_sim_gpus",
    8,
    "Largest cluster simulated whole (beyond: per-instance goodput x count).",
    flag_values=FLAGS,
)
flags.DEFINE_bool("verbose", False, "Print every configuration's goodput.", flag_values=FLAGS)


@dataclasses.dataclass(frozen=True)
class Workload:
  """Poisson arrivals with seeded lengths; at a rate, max(requests, rate * horizon) requests, so
  that a fast rate still runs long enough to queue (a short burst flatters every system)."""

  prompt: Lengths
  output: Lengths
  requests: int
  seed: int = 0
  horizon: float = 0.0  # seconds of arrivals at least
  vocab: int = 0  # > 0: exactly serve_bench's requests (workload.generate), `requests` of them

  def arrivals(self, rate: float) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, output tokens): one seeded draw per request index, so a longer
    run extends a shorter one; arrivals scaled to `rate`."""
    n = max(self.requests, math.ceil(rate * self.horizon))
    if self.vocab:
      return [
          (w.arrival, len(w.prompt), w.max_tokens)
          for w in generate(n, rate, self.prompt, self.output, self.vocab, self.seed)
      ]
    return [(a / rate, p, o) for a, p, o in _base(self.prompt, self.output, n, self.seed)]


_BASES: dict = {}


def _base(prompt: Lengths, output: Lengths, n: int, seed: int) -> list[tuple[float, int, int]]:
  """The first n requests at 1 request/s (cached and extended: every probe reuses them)."""
  key = (prompt, output, seed)
  have = _BASES.get(key, [])
  if len(have) < n:
    gaps = np.random.default_rng([seed, 0]).exponential(1.0, n)
    rng = np.random.default_rng([seed, 1])
    lengths = [(prompt.sample(rng), output.sample(rng)) for _ in range(n)]
    have = _BASES[key] = [(float(a), p, o) for a, (p, o) in zip(np.cumsum(gaps), lengths)]
  return have[:n]


def goodput(cluster: sim.Cluster, work: Workload, slo: SLO, start: float, probes: int = 9):
  """The simulated goodput search (rates from `start`)."""
  return search_goodput(
      lambda rate: attainment(sim.simulate(cluster, work.arrivals(rate)), slo),
      [start],
      slo.attainment,
      max_probes=probes,
  )


# -- cluster scale ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
  """One worker configuration: its role, tensor-parallel size and scheduling."""

  role: str  # 'colocated', 'prefill', 'decode'
  tp: int
  max_batch: int
  token_budget: int
  policy: str = "decode-first"

  def label(self) -> str:
    extra = f", budget {self.token_budget}" if self.role != "decode" else ""
    extra += ", prefill-first" if self.policy == "prefill-first" else ""
    return f"{self.role} tp{self.tp} batch {self.max_batch}{extra}"


def pool(kind: Kind, model: sim.ModelShape, count: int, page: int) -> sim.Pool:
  roof = sim.Roofline(model, tp=kind.tp)
  return sim.Pool(
      count, roof, kind.max_batch, kind.token_budget, roof.kv_capacity() // page, kind.policy
  )


FREE = sim.Pool(
    1,
    type("Free", (), {"step_time": lambda self, new, context: 0.0})(),
    max_batch=1 << 20,
    token_budget=1 << 30,
    kv_pages=1 << 40,
)  # the other phase


def cluster_of(
    model: sim.ModelShape,
    page: int,
    colocated: Kind | None = None,
    prefill: tuple[Kind, int] | None = None,
    decode: tuple[Kind, int] | None = None,
) -> sim.Cluster:
  """A cluster of roofline workers; a missing side of a disaggregated one costs nothing."""
  kvb = model.kv_bytes_per_token()
  if colocated is not None:
    return sim.Cluster(page, colocated=pool(colocated, model, 1, page))
  p = pool(prefill[0], model, prefill[1], page) if prefill else FREE
  d = pool(decode[0], model, decode[1], page) if decode else FREE
  tps = [side[0].tp for side in (prefill, decode) if side is not None]
  return sim.Cluster(
      page,
      prefill=p,
      decode=d,
      kv_bytes_per_token=kvb,
      transfer_bw=NIC_BW * min(tps),
      transfer_latency=NIC_LATENCY,
  )


def fits(model: sim.ModelShape, tp: int) -> bool:
  """The weights and at least 16k tokens of K/V fit in tp GPUs."""
  return sim.Roofline(model, tp=tp).kv_capacity() >= 16384


def scale_cluster(model, page, choice: dict, gpus: int) -> sim.Cluster:
  """The whole cluster of one choice (workers of each kind as counted)."""
  kvb = model.kv_bytes_per_token()
  if choice["role"] == "colocated":
    k = choice["kind"]
    return sim.Cluster(page, colocated=pool(k, model, gpus // k.tp, page))
  (pk, n_p), (dk, n_d) = choice["prefill"], choice["decode"]
  return sim.Cluster(
      page,
      prefill=pool(pk, model, n_p, page),
      decode=pool(dk, model, n_d, page),
      kv_bytes_per_token=kvb,
      transfer_bw=NIC_BW * min(pk.tp, dk.tp),
      transfer_latency=NIC_LATENCY,
  )


def per_instance(
    model, page, work: Workload, slo: SLO, kinds: list[Kind], probes: int, log
) -> dict[Kind, float]:
  """Each kind's goodput as one instance, the other phase free."""
  out = {}
  for k in kinds:
    t0 = time.perf_counter()
    c = (
        cluster_of(model, page, colocated=k)
        if k.role == "colocated"
        else cluster_of(model, page, prefill=(k, 1))
        if k.role == "prefill"
        else cluster_of(model, page, decode=(k, 1))
    )
    w = work if k.role != "prefill" else dataclasses.replace(work, output=Lengths.parse("1"))
    # (a prefill worker is judged on TTFT alone: one output token, nothing to decode)
    r = sim.Roofline(model, tp=k.tp)
    # start near the rate one instance could carry if it only computed
    mean_p = np.mean([p for _, p, _ in w.arrivals(1.0)])
    mean_o = np.mean([o for *_, o in w.arrivals(1.0)])
    start = 0.5 / (
        r.step_time([int(mean_p)], [int(mean_p)])
        + mean_o * r.step_time([1] * 32, [int(mean_p + mean_o / 2)] * 32) / 32
    )
    out[k] = goodput(c, w, slo, start, probes).goodput
    log(
        f"#   {model.name} {k.label()}: {out[k]:.2f} req/s per instance "
        f"({time.perf_counter() - t0:.1f} s)"
    )
  return out


def best_split(gpus: int, prefill: dict[Kind, float], decode: dict[Kind, float], top: int):
  """The (prefill kind, count, decode kind, count) that maximise min(rates) within `gpus`."""
  options = []
  for (pk, gp), (dk, gd) in itertools.product(prefill.items(), decode.items()):
    for n_p in range(1, gpus // pk.tp):
      n_d = (gpus - n_p * pk.tp) // dk.tp
      if n_d >= 1:
        options.append((min(n_p * gp, n_d * gd), pk, n_p, dk, n_d))
  options.sort(key=lambda o: -o[0])
  return options[:top]


MODELS = {"8b": sim.LLAMA3_8B, "70b": sim.LLAMA3_70B}


def _ints(flag: str, text: str) -> list[int]:
  try:
    xs = [int(x) for x in text.split(",")]
  except ValueError:
    raise SystemExit(f"--{flag}={text!r}: give comma-separated integers, e.g. 8,16") from None
  if min(xs) < 1:
    raise SystemExit(f"--{flag}={text!r}: every value must be >= 1")
  return xs


def slo_flag(args, flag: str) -> SLO:
  """--slo_8b or --slo_70b (TTFT,TPOT in seconds) as an SLO; SystemExit with one line if bad."""
  values = getattr(args, flag)
  try:
    ttft, tpot = (float(v) for v in values)
  except ValueError:
    raise SystemExit(
        f"--{flag}={','.join(values)}: give TTFT,TPOT in seconds, e.g. 0.2,0.02"
    ) from None
  try:
    return SLO(ttft, tpot)
  except ValueError as e:
    raise SystemExit(f"--{flag}: {e}") from None


def check_args(args) -> None:
  """Bad flags end the run here with one line naming them, before any profiling or simulation."""
  for flag in ("repeats", "requests", "probes", "top", "max_sim_gpus"):
    if getattr(args, flag) < 1:
      raise SystemExit(f"--{flag}={getattr(args, flag)} must be >= 1")
  if not args.cores > 0:
    raise SystemExit(f"--cores={args.cores} must be > 0 (a fraction: the share of a core)")
  if not args.horizon >= 0:
    raise SystemExit(f"--horizon={args.horizon} must be >= 0 seconds")
  for flag in ("gpus", "batches", "budgets"):
    _ints(flag, getattr(args, flag))
  unknown = [m for m in args.models.split(",") if m not in MODELS]
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}; choose from {','.join(MODELS)}")
  for flag in ("slo_8b", "slo_70b"):
    slo_flag(args, flag)
  for flag in ("prompt", "output"):
    try:
      Lengths.parse(getattr(args, flag))
    except ValueError as e:
      raise SystemExit(f"--{flag}: {e}") from None


def cluster_table(args) -> None:
  page = 16
  work = Workload(
      Lengths.parse(args.prompt), Lengths.parse(args.output), args.requests, args.seed, args.horizon
  )
  models = {
      "8b": (MODELS["8b"], slo_flag(args, "slo_8b")),
      "70b": (MODELS["70b"], slo_flag(args, "slo_70b")),
  }
  sizes = _ints("gpus", args.gpus)
  each = SLO(1.0, 1.0, 0.95)
  print(
      f"# simulated, not measured: roofline costs on H200 ({sim.H200.flops / 1e12:.0f} TFLOP/s "
      f"bf16, {sim.H200.hbm_bw / 1e12:.1f} TB/s HBM, {sim.H200.memory / 1e9:.0f} GB, NVLink "
      f"{sim.H200.link_bw / 1e9:.0f} GB/s a direction for tensor parallelism), no efficiency "
      f"factor; K/V copies over {NIC_BW / 1e9:.0f} GB/s x min(tp) NICs + {1e6 * NIC_LATENCY:.0f} "
      f"us; workload: Poisson arrivals, prompt {work.prompt}, output {work.output} tokens, "
      f"max({work.requests}, rate x {work.horizon:g} s) requests per probe, seed {work.seed}; "
      f"pages of {page}"
  )
  print(
      "| model | GPUs | colocated, chunked prefill: goodput (req/s) | colocated, prefill-first | "
      "disaggregated | disaggregated vs colocated (chunked / prefill-first) | SLO disaggregated "
      "meets at the lower goodput of the two, times tighter (chunked / prefill-first) | GPUs "
      "disaggregated needs for chunked colocated's goodput | figures from |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for name in args.models.split(","):
    model, slo = models[name]
    inst = lambda role_slo: SLO(role_slo[0], role_slo[1], each.attainment)
    tps = [t for t in (1, 2, 4, 8) if fits(model, t)]
    batches, budgets = _ints("batches", args.batches), _ints("budgets", args.budgets)
    kvb = model.kv_bytes_per_token()
    r1 = sim.Roofline(model, tp=tps[0])
    mean_p = int(np.mean([p for _, p, _ in work.arrivals(1.0)]))
    print(
        f"# {model.name}: {model.params / 1e9:.2f}B parameters, {kvb / 2**10:.0f} KiB of K/V per "
        f"token; SLO TTFT <= {1e3 * slo.ttft:g} ms, TPOT <= {1e3 * slo.tpot:g} ms for 90%; "
        f"tp {tps[0]}: prefill of the mean prompt ({mean_p} tokens) "
        f"{1e3 * r1.step_time([mean_p], [mean_p]):.1f} ms, its K/V copy "
        f"{1e3 * (NIC_LATENCY + kvb * mean_p / (NIC_BW * tps[0])):.2f} ms, a decode step of 1 / "
        f"128 sequences at {mean_p} tokens {1e3 * r1.step_time([1], [mean_p]):.1f} / "
        f"{1e3 * r1.step_time([1] * 128, [mean_p] * 128):.1f} ms",
        flush=True,
    )
    log = print if args.verbose else (lambda *a, **k: None)
    colo = per_instance(
        model,
        16,
        work,
        slo,
        [Kind("colocated", tp, b, budget) for tp in tps for b in batches for budget in budgets]
        + [
            Kind("colocated", tp, b, max(budgets[-1], work.prompt.high), "prefill-first")
            for tp in tps
            for b in batches
        ],
        args.probes,
        log,
    )
    pre = per_instance(
        model,
        16,
        work,
        inst((slo.ttft, 1e9)),
        [Kind("prefill", tp, max(batches), max(budgets[-1], work.prompt.high)) for tp in tps],
        args.probes,
        log,
    )
    dec = per_instance(
        model,
        16,
        work,
        inst((1e9, slo.tpot)),
        [Kind("decode", tp, b, max(b, 512)) for tp in tps for b in batches],
        args.probes,
        log,
    )
    for gpus in sizes:
      found = {}
      for policy in ("decode-first", "prefill-first"):
        k, g = max(
            ((k, g / k.tp) for k, g in colo.items() if k.policy == policy), key=lambda kg: kg[1]
        )
        found[policy] = {
            "role": "colocated",
            "kind": k,
            "estimate": g * gpus,
            "label": f"{gpus // k.tp} x [{k.label()}]",
        }
      found["disaggregated"] = [
          {
              "role": "disaggregated",
              "prefill": (pk, n_p),
              "decode": (dk, n_d),
              "estimate": est,
              "label": f"{n_p} x P tp{pk.tp} + {n_d} x D tp{dk.tp} batch {dk.max_batch}",
          }
          for est, pk, n_p, dk, n_d in best_split(gpus, pre, dec, args.top)
      ]
      cc, cp = found["decode-first"], found["prefill-first"]
      # Splitwise's question: how many GPUs does disaggregation need for colocated's goodput?
      fewer = next(
          (
              n
              for n in range(2, gpus + 1)
              if best_split(n, pre, dec, 1) and best_split(n, pre, dec, 1)[0][0] >= cc["estimate"]
          ),
          None,
      )
      tighter = ""
      if gpus <= args.max_sim_gpus:  # simulate whole clusters; keep the best disaggregated one
        whole = dataclasses.replace(work, horizon=work.horizon / 4)  # many workers queue sooner
        for choice in [cc, cp] + found["disaggregated"]:
          c = scale_cluster(model, page, choice, gpus)
          t0 = time.perf_counter()
          choice["cluster"] = c
          choice["simulated"] = goodput(
              c, whole, slo, max(choice["estimate"], 1e-3), args.probes
          ).goodput
          log(
              f"#   {gpus} GPUs, {choice['label']}: {choice['simulated']:.2f} req/s simulated "
              f"whole ({time.perf_counter() - t0:.1f} s)"
          )
        found["disaggregated"] = max(found["disaggregated"], key=lambda c: c["simulated"])
        # DistServe's other question: at a rate both carry, how tight an SLO can each meet?
        rate = max(min(cc["simulated"], found["disaggregated"]["simulated"]), 1e-3)
        scale = {
            name: slo.tightest_scale(sim.simulate(found[name]["cluster"], whole.arrivals(rate)))
            for name in ("decode-first", "prefill-first", "disaggregated")
        }
        tighter = (
            f"{scale['decode-first'] / scale['disaggregated']:.2f}x / "
            f"{scale['prefill-first'] / scale['disaggregated']:.2f}x"
        )
      else:
        found["disaggregated"] = found["disaggregated"][0]
      rows.append((model, slo, gpus, found))
      fig = lambda c: c.get("simulated", c["estimate"])
      d = found["disaggregated"]
      print(
          f"| {model.name} | {gpus} | {cc['label']}: {fig(cc):,.1f} | {cp['label']}: "
          f"{fig(cp):,.1f} | {d['label']}: {fig(d):,.1f} | {fig(d) / max(fig(cc), 1e-9):.2f}x / "
          f"{fig(d) / max(fig(cp), 1e-9):.2f}x | {tighter} | {fewer or '> ' + str(gpus)} | "
          f"{'whole cluster' if 'simulated' in d else 'per instance x count'} |",
          flush=True,
      )


# -- this machine ----------------------------------------------------------------------------------


def profile_engine(engine, repeats: int, calibration: list, log) -> sim.StepTable:
  """Times every compiled step program on the engine's device (dispatch to result), then fits
  the host time of a step (scheduling, dispatch, applying results) per step and per sequence from
  the engine serving `calibration` (a list of workload.Work) alone."""
  import jax

  from jaxpipe.serve import batch as batch_lib
  from jaxpipe.serve import model as model_lib
  from jaxpipe.serve.sampling import MAX_BANNED, SamplingBatch

  engine.precompile()
  i32 = lambda *shape: np.zeros(shape, np.int32)
  samples = {tn: [] for tn in engine.programs}
  for _ in range(repeats + 1):  # round robin, so that the machine's load drifts over all alike
    for t, n in engine.programs:
      r = batch_lib.row_count(t, engine.max_batch)
      batch = model_lib.TokenBatch(
          i32(t), i32(t), i32(t), i32(t, n), i32(r), i32(r, n), i32(r), i32(r), i32(r), i32(t) - 1
      )
      sampling = SamplingBatch(
          np.zeros(r, np.float32),
          i32(r),
          np.ones(r, np.float32),
          i32(r),
          i32(r),
          np.full((r, MAX_BANNED), -1, np.int32),
      )
      t0 = time.perf_counter()
      program = engine.step_program(t, n)
      out, _, _, engine.kv = program(
          engine.params, engine.kv, batch, sampling, i32(engine.max_batch)
      )
      np.asarray(out)
      samples[(t, n)].append(time.perf_counter() - t0)
  times = {tn: float(np.median(x[1:])) for tn, x in samples.items()}
  # host time of a real run's steps: scheduling and dispatch, then applying the results once the
  # program is done (not waiting for it), against the sequences in the step
  hosts, rows = [], []
  for w in calibration:
    engine.add_request(w.prompt, w.max_tokens, eos_id=None)
  while engine.has_work():
    t0 = time.perf_counter()
    launched = engine.launch()
    t1 = time.perf_counter()
    if launched is not None:
      jax.block_until_ready((launched.new_R, launched.finite_R))
    t2 = time.perf_counter()
    engine.collect(launched)
    if launched is not None:
      hosts.append(t1 - t0 + time.perf_counter() - t2)
      rows.append(len(launched.plan))
  engine.finished()
  a = np.stack([np.ones(len(rows)), np.asarray(rows, float)], 1)
  (host_step, host_row), *_ = np.linalg.lstsq(a, np.asarray(hosts), rcond=None)
  log(
      f"# profile: {len(times)} step programs, {1e3 * min(times.values()):.2f}-"
      f"{1e3 * max(times.values()):.2f} ms; host {1e3 * host_step:.2f} ms per step + "
      f"{1e6 * host_row:.0f} us per sequence (fitted over {len(hosts)} steps)"
  )
  return sim.StepTable(times, engine.page_size, max(host_step, 0.0), max(host_row, 0.0))


def cpu_cluster(
    table: sim.StepTable,
    args,
    colocated: int = 0,
    prefill: int = 0,
    decode: int = 0,
    decode_batch: int | None = None,
) -> sim.Cluster:
  """This machine's deployment: lock-step iterations over workers sharing the host."""
  pages = args.kv_tokens // args.page_size
  mk = lambda count, batch: sim.Pool(count, table, batch, args.token_budget, pages)
  if colocated:
    return sim.Cluster(
        args.page_size, colocated=mk(colocated, args.max_batch), lockstep=True, cores=args.cores
    )
  return sim.Cluster(
      args.page_size,
      prefill=mk(prefill, args.max_batch),
      decode=mk(decode, decode_batch or args.max_batch),
      lockstep=True,
      cores=args.cores,
      kv_bytes_per_token=args.kv_bytes_per_token,
      transfer_bw=args.transfer_bw,
      transfer_latency=args.transfer_latency,
  )


def cpu_plan(args) -> None:
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  from experiments import serve_bench, serving
  from jaxpipe.serve.engine import Engine
  from jaxpipe.serve.model import kv_bytes

  try:  # serve_bench's own flags, in its FlagValues (this process runs pd_plan's)
    rest = cli.parse(serve_bench.FLAGS, ["serve_bench", *args.bench_args.split()])
    cli.no_arguments(rest)
  except app.UsageError as e:
    raise SystemExit(f"--bench_args={args.bench_args!r}: {e}") from None
  sb = cli.values(serve_bench.FLAGS)
  modes, slo = serve_bench.check_deployment_args(sb)
  prompt, output = serving.parse_lengths(sb)
  cfg, params = serve_bench.QUICKSTART, serve_bench.quickstart_params()
  s = sb.page_size
  max_len = math.ceil((prompt.high + output.high) / s) * s
  engine = Engine(cfg, params, **serve_bench.engine_args(sb, max_len))
  calibration = generate(24, 1.0, prompt, output, cfg.vocab, sb.seed + 1)
  table = profile_engine(engine, args.repeats, calibration, print)
  sb.kv_bytes_per_token = kv_bytes(cfg, 1, 1)
  sb.transfer_bw = args.transfer_bw  # inf: a host copy, negligible beside a step
  sb.transfer_latency = args.transfer_latency
  sb.cores = args.cores
  work = Workload(prompt, output, sb.requests, sb.seed, sb.horizon, vocab=cfg.vocab)
  rates = [float(r) for r in sb.rates.split(",")]
  n = sb.prefill_workers + sb.decode_workers
  print(
      f"# plan for {n} host devices sharing {args.cores} cores, one device per worker; "
      f"SLO TTFT <= {1e3 * slo.ttft:g} ms, TPOT <= {1e3 * slo.tpot:g} ms; prompt {prompt}, "
      f"output {output}; lock-step simulation over the profile"
  )
  print("| deployment | simulated goodput (req/s) |")
  print("|---|---|")
  options = [("colocated", w, 0, 0, None) for w in range(1, n + 1)] + [
      ("disaggregated", 0, p, d, b)
      for p in range(1, n)
      for d in range(1, n - p + 1)
      for b in sorted({8, 16, sb.max_batch})
  ]
  results = []
  for mode, w, p, d, b in options:
    c = cpu_cluster(table, sb, w, p, d, b)
    g = goodput(c, work, slo, rates[0], args.probes).goodput
    label = f"{w} workers" if w else f"{p} P + {d} D, decode batch {b}"
    results.append((g, mode, label))
  for g, mode, label in sorted(results, reverse=True)[: args.top]:
    print(f"| {mode}, {label} | {g:g} |")
  configs = {
      "colocated": cpu_cluster(table, sb, colocated=sb.workers or n),
      "disaggregated": cpu_cluster(table, sb, prefill=sb.prefill_workers, decode=sb.decode_workers),
  }
  print(
      f"# predicted for the measured deployments (colocated {sb.workers or n} workers, "
      f"disaggregated {sb.prefill_workers} P + {sb.decode_workers} D)"
  )
  predicted = {}
  for mode in modes:
    for rate in rates:
      predicted[(mode, rate)] = summary(sim.simulate(configs[mode], work.arrivals(rate)), slo)
    predicted[(mode, "goodput")] = goodput(configs[mode], work, slo, rates[0], args.probes).goodput
  measured = serve_bench.measure(sb, modes, slo, rates) if args.measure else {}
  print(
      "| deployment | rate (req/s) | TTFT p50 / p90 (ms) predicted | measured | "
      "TPOT p50 / p90 (ms) predicted | measured | SLO met predicted | measured |"
  )
  print("|---|---|---|---|---|---|---|---|")
  ms = lambda a, b: f"{1e3 * a:,.0f} / {1e3 * b:,.0f}"
  for (mode, rate), pr in predicted.items():
    if rate == "goodput":
      got = measured.get((mode, "goodput"))
      print(
          f"| {mode} | goodput | | | | | {pr:g} req/s | "
          f"{'' if got is None else f'{got:g} req/s'} |"
      )
      continue
    me = measured.get((mode, rate))
    cells = [
        ms(pr["ttft50"], pr["ttft90"]),
        ms(me["ttft50"], me["ttft90"]) if me else "",
        f"{1e3 * pr['tpot50']:.1f} / {1e3 * pr['tpot90']:.1f}",
        f"{1e3 * me['tpot50']:.1f} / {1e3 * me['tpot90']:.1f}" if me else "",
        f"{100 * pr['met']:.0f}%",
        f"{100 * me['met']:.0f}%" if me else "",
    ]
    print(f"| {mode} | {rate:g} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  check_args(args)
  if args.cpu:
    cpu_plan(args)
  else:
    cluster_table(args)


if __name__ == "__main__":
  cli.run(main)
