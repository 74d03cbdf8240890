"""Discrete-event simulation of colocated and disaggregated serving over a cost model (pure Python).

Each simulated worker runs the engine's own scheduler (`serve.scheduler.Scheduler`) over a count
of free pages: running requests first, oldest first (a decode token or the next prompt chunk),
then waiting ones in arrival order while the batch, the token budget and the free pages allow;
pages are taken as tokens are computed, and when none is left the newest running request is
preempted and recomputed later. (`policy='prefill-first'` instead runs whole waiting prompts in a
step of their own before any decoding, as vLLM's first scheduler did: the baseline DistServe
measured.) A prefill worker parks a request once its first token is sampled; the deployments'
router (`serve.placement`) hands it to the decode worker with a free slot and the most free pages,
whose pages are reserved; the copy takes `Cluster.transfer_time(tokens)` and the request joins
that decoder's batch at its first step boundary after the copy lands, when the prefill worker
frees its pages. New requests go to the entry worker the router picks (the fewest prompt tokens
left to compute on a prefill worker, the fewest requests on a colocated one).

Two clocks: `lockstep=False` (GPUs): every worker runs its steps back to back on its own
devices. `lockstep=True` (this machine's driver): one host loop steps every busy worker in turn
and the iteration lasts the sum of their host times (one Python thread) plus max(longest device
time, sum of the device times / cores), the steps' programs sharing the host's `cores` (perfect
packing: a lower bound); copies land in the next iteration, as `serve.deploy` runs them on CPU
host devices.

Cost models give a step's seconds from what it computes: `step_time(new, context)`, `new[i]`
tokens of sequence i computed at context lengths `context[i]` (keys cached after the step).
`Roofline` derives it from a model's FLOPs and bytes on `tp` GPUs; `StepTable` from times
measured on this machine for each compiled step program.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Protocol

from jaxpipe.serve import placement, slo
from jaxpipe.serve.scheduler import Scheduler


class CostModel(Protocol):

  def step_time(self, new: Sequence[int], context: Sequence[int]) -> float:
    """Seconds of one step that computes `new[i]` tokens of sequence i.

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      The step's seconds.
    """
    ...


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the roofline needs of a decoder-only Transformer (GQA, SwiGLU MLP, untied head)."""

  name: str
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  d_ff: int
  vocab: int

  @property
  def layer_params(self) -> int:
    """Matmul weights of one layer: q and o, k and v, and three MLP matrices."""
    return (
        2 * self.d_model * self.heads * self.head_dim
        + 2 * self.d_model * self.kv_heads * self.head_dim
        + 3 * self.d_model * self.d_ff
    )

  @property
  def params(self) -> int:
    """All weights: layers, embedding and output head (norms left out)."""
    return self.layers * self.layer_params + 2 * self.vocab * self.d_model

  def kv_bytes_per_token(self, itemsize: int = 2) -> int:
    """Bytes of K and V one token keeps over every layer.

    Args:
      itemsize: bytes per element.

    Returns:
      2 · layers · kv_heads · head_dim · itemsize.
    """
    return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256)


@dataclasses.dataclass(frozen=True)
class GPU:
  name: str
  flops: float  # dense bf16 FLOP/s
  hbm_bw: float  # bytes/s
  memory: float  # bytes
  link_bw: float  # bytes/s per direction between GPUs of one worker (tensor parallel)


H200 = GPU("H200", 989e12, 4.8e12, 141e9, 450e9)  # NVLink 4: 900 GB/s both directions


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A step costs max(FLOPs / peak, bytes / HBM bandwidth) on tp GPUs, plus its tensor-parallel
  all-reduces (two per layer, ring) over the GPUs' links. Peak figures: no efficiency factor."""

  model: ModelShape
  gpu: GPU = H200
  tp: int = 1
  itemsize: int = 2  # bf16 weights and K/V
  allreduce_latency: float = 10e-6  # seconds per all-reduce beyond its bandwidth term

  def flops(self, new: Sequence[int], context: Sequence[int]) -> float:
    """FLOPs of one step: layer matmuls, causal attention, the head on each sequence's last token.

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      The FLOPs.
    """
    m = self.model
    t = sum(new)
    # Causal attention: new token j of a sequence with c keys after the step sees c - n + 1 + j.
    attn = sum(n * (c - (n - 1) / 2) for n, c in zip(new, context))
    return (
        2 * t * m.layers * m.layer_params
        + 4 * m.layers * m.heads * m.head_dim * attn
        + 2 * len(new) * m.vocab * m.d_model
    )  # the head, on each sequence's last token

  def bytes(self, new: Sequence[int], context: Sequence[int]) -> float:
    """HBM bytes of one step: every weight read once, its context's K/V read, its new K/V written.

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      The bytes.
    """
    m = self.model
    weights = (m.layers * m.layer_params + m.vocab * m.d_model) * self.itemsize
    return weights + m.kv_bytes_per_token(self.itemsize) * (sum(context) + sum(new))

  def step_time(self, new: Sequence[int], context: Sequence[int]) -> float:
    """max(FLOPs / peak, bytes / HBM bandwidth) on tp GPUs, plus the tensor-parallel all-reduces.

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      The step's seconds.
    """
    g, tp = self.gpu, self.tp
    t = max(self.flops(new, context) / (tp * g.flops), self.bytes(new, context) / (tp * g.hbm_bw))
    if tp > 1:
      size = sum(new) * self.model.d_model * self.itemsize
      t += 2 * self.model.layers * (2 * (tp - 1) / tp * size / g.link_bw + self.allreduce_latency)
    return t

  def kv_capacity(self, reserve: float = 0.1) -> int:
    """Tokens of K/V that fit beside the weights in tp GPUs' memory, `reserve` of it kept free.

    Args:
      reserve: the fraction of memory kept free.

    Returns:
      The token count, at least 0.
    """
    free = self.tp * self.gpu.memory * (1 - reserve) - self.model.params * self.itemsize
    return max(0, int(free // self.model.kv_bytes_per_token(self.itemsize)))


def _bucket(n: int, buckets: Sequence[int]) -> int:
  return next(b for b in buckets if b >= n)


@dataclasses.dataclass(frozen=True)
class StepTable:
  """Measured: seconds of the compiled step for each (token bucket, pages-per-sequence bucket),
  plus host time per step and per scheduled sequence (scheduling, packing, reading back)."""

  times: dict[tuple[int, int], float]
  page_size: int
  host_step: float = 0.0
  host_row: float = 0.0

  def host_time(self, new: Sequence[int], context: Sequence[int]) -> float:
    """The part of `step_time` spent in the host's Python (one thread for every worker).

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      host_step + host_row per scheduled sequence.
    """
    return self.host_step + self.host_row * len(new)

  def step_time(self, new: Sequence[int], context: Sequence[int]) -> float:
    """The measured time of the step program the step runs in, plus its host time.

    Its token bucket holds the step's tokens, its pages bucket the longest context's pages.

    Args:
      new: tokens of each sequence computed in the step.
      context: each sequence's context length (keys cached after the step).

    Returns:
      The step's seconds.
    """
    tokens = sorted({t for t, _ in self.times})
    pages = sorted({n for _, n in self.times})
    t = _bucket(sum(new), tokens)
    n = _bucket(max(math.ceil(c / self.page_size) for c in context), pages)
    return self.times[(t, n)] + self.host_time(new, context)


@dataclasses.dataclass(frozen=True)
class Pool:
  """One kind of worker: how many, how each schedules, and its cost model."""

  count: int
  cost: CostModel
  max_batch: int  # sequences per step
  token_budget: int  # tokens per step
  kv_pages: int  # pages of page_size tokens per worker
  policy: str = "decode-first"  # or 'prefill-first' (whole prompts, before any decoding)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Colocated (`colocated` set) or disaggregated (`prefill` and `decode` set) workers."""

  page_size: int
  colocated: Pool | None = None
  prefill: Pool | None = None
  decode: Pool | None = None
  kv_bytes_per_token: int = 0  # for the copy from prefill to decode
  transfer_bw: float = math.inf  # bytes/s of one copy
  transfer_latency: float = 0.0  # seconds per copy
  lockstep: bool = False  # one host loop steps every worker in turn (CPU host devices)
  cores: float = 1  # lockstep: the workers' steps share this many cores (< 1: a loaded share)
  iteration_overhead: float = 0.0  # lockstep: host seconds per iteration beyond the steps

  def __post_init__(self):
    if (self.colocated is None) == (self.prefill is None and self.decode is None):
      raise ValueError("give either a colocated pool or both prefill and decode pools")
    if self.colocated is None and (
        self.prefill is None
        or self.decode is None
        or self.prefill.count < 1
        or self.decode.count < 1
    ):
      raise ValueError("a disaggregated cluster needs at least one prefill and one decode worker")

  @property
  def disaggregated(self) -> bool:
    return self.colocated is None

  def transfer_time(self, tokens: int) -> float:
    """One request's copy: its pages' K/V (pages rounded up) over the link.

    Args:
      tokens: the request's cached tokens.

    Returns:
      The copy's seconds: its latency plus its bytes over the bandwidth.
    """
    pages = math.ceil(tokens / self.page_size)
    nbytes = pages * self.page_size * self.kv_bytes_per_token
    return self.transfer_latency + nbytes / self.transfer_bw


@dataclasses.dataclass(eq=False)
class SimRequest:
  id: int
  arrival: float
  prompt: int  # tokens
  max_tokens: int
  computed: int = 0
  generated: int = 0
  pages: int = 0
  first_token_time: float | None = None
  last_token_time: float | None = None
  finish_time: float | None = None
  error: str | None = None
  preemptions: int = 0
  transfer_bytes: int = 0

  @property
  def length(self) -> int:
    return self.prompt + self.generated

  @property
  def ttft(self) -> float | None:
    return slo.ttft(self.arrival, self.first_token_time)

  @property
  def tpot(self) -> float | None:
    return slo.tpot(self.first_token_time, self.last_token_time, self.generated)


class CountedPages:
  """`scheduler.Pages` as a count of free pages of `page_size` tokens, with no prefix cache (every
  prompt is computed whole): the simulator's page side, and the toy pages of the scheduler's own
  tests."""

  def __init__(self, free: int, page_size: int):
    self.free, self.page_size = free, page_size

  @property
  def num_free(self) -> int:
    return self.free

  def can_alloc(self, n: int) -> bool:
    """Whether n pages are free.

    Args:
      n: pages wanted.

    Returns:
      True if at least n are free.
    """
    return self.free >= n

  def match_prefix(self, r) -> bool:
    """No prefix cache: every prompt is computed whole.

    Args:
      r: the request.

    Returns:
      False.
    """
    return False

  def reserve(self, r, n: int) -> bool:
    """Pages for r's tokens computed..computed+n-1.

    Args:
      r: the request; its `pages` count grows by the pages taken.
      n: tokens to hold.

    Returns:
      True; False, taking nothing, if too few are free.
    """
    need = math.ceil((r.computed + n) / self.page_size) - r.pages
    if need > self.free:
      return False
    self.free -= need
    r.pages += need
    return True

  def release(self, r) -> None:
    """Frees every page r holds.

    Args:
      r: the request; its `pages` count drops to 0.
    """
    self.free += r.pages
    r.pages = 0


class _Worker(CountedPages):
  """A simulated worker: the engine's scheduler over `CountedPages`."""

  def __init__(self, name: str, pool: Pool, page_size: int, kind: str):
    super().__init__(pool.kv_pages, page_size)
    self.name, self.pool, self.kind = name, pool, kind
    self.scheduler: Scheduler[SimRequest] = Scheduler(
        self, max_batch=pool.max_batch, token_budget=pool.token_budget, policy=pool.policy
    )
    self.busy_until: float | None = None  # independent clock: when its current step ends
    self.steps = 0

  # -- steps --

  def cost(self, plan) -> float:
    return self.pool.cost.step_time([n for _, n in plan], [r.computed + n for r, n in plan])

  def host_cost(self, plan) -> float:
    """The host-thread part of `cost` (0 unless the cost model says: `host_time`)."""
    host = getattr(self.pool.cost, "host_time", None)
    return host([n for _, n in plan], [r.computed + n for r, n in plan]) if host else 0.0

  def apply(self, plan, now: float) -> list[SimRequest]:
    """The step ended at `now`: returns the requests that sampled a token and are parked
    (prefill) or finished."""
    self.steps += 1
    out = []
    for r, n in plan:
      r.computed += n
      if r.computed < r.length:
        continue
      r.generated += 1
      r.last_token_time = now
      if r.first_token_time is None:
        r.first_token_time = now
      if r.generated >= r.max_tokens:
        self.scheduler.remove(r)  # its pages are freed now
        r.finish_time = now
        out.append(r)
      elif self.kind == "prefill":
        self.scheduler.park(r)
        out.append(r)
    return out


def simulate(
    cluster: Cluster,
    arrivals: Sequence[tuple[float, int, int]],
    trace: dict[str, list] | None = None,
) -> list[SimRequest]:
  """Serves (arrival seconds, prompt tokens, output tokens) requests.

  Args:
    cluster: the workers, their cost models and clock (module docstring).
    arrivals: (arrival seconds, prompt tokens, output tokens) per request.
    trace: filled with each worker's scheduling decisions (`Scheduler.trace`), by worker name.

  Returns:
    The requests, finished; a request that needs more pages than a worker has is not served,
    its `error` saying so.
  """
  reqs = [SimRequest(i, a, p, o) for i, (a, p, o) in enumerate(arrivals)]
  s = cluster.page_size
  for r in reqs:
    pools = [cluster.colocated] if not cluster.disaggregated else [cluster.prefill, cluster.decode]
    need = math.ceil((r.prompt + r.max_tokens) / s)
    small = min(pools, key=lambda p: p.kv_pages)
    if need > small.kv_pages:
      r.error = f"needs {need} pages, a worker has {small.kv_pages}"
  if cluster.disaggregated:
    entry = [_Worker(f"P{i}", cluster.prefill, s, "prefill") for i in range(cluster.prefill.count)]
    decode = [_Worker(f"D{i}", cluster.decode, s, "decode") for i in range(cluster.decode.count)]
  else:
    entry = [
        _Worker(f"W{i}", cluster.colocated, s, "colocated") for i in range(cluster.colocated.count)
    ]
    decode = []
  if trace is not None:
    for w in entry + decode:
      w.scheduler.trace = trace.setdefault(w.name, [])
  sim = _Sim(cluster, entry, decode)
  todo = [r for r in reqs if r.error is None]
  (sim.run_lockstep if cluster.lockstep else sim.run_events)(todo)
  return reqs


class _Sim:

  def __init__(self, cluster: Cluster, entry: list[_Worker], decode: list[_Worker]):
    self.cluster, self.entry, self.decode = cluster, entry, decode
    self.handoff: collections.deque[tuple[_Worker, SimRequest]] = collections.deque()

  def route(self, r: SimRequest) -> None:
    placement.entry_worker(self.entry, prefill=self.cluster.disaggregated).scheduler.add(r)

  def start_transfers(self, now: float) -> list[tuple[float, _Worker, _Worker, SimRequest]]:
    """Reserves a decode worker for every parked request that fits one; returns the copies
    (landing time, source, destination, request)."""
    started, left = [], collections.deque()
    while self.handoff:
      src, r = self.handoff.popleft()
      pages = math.ceil(r.computed / self.cluster.page_size)
      d = placement.decode_worker(self.decode, pages)
      if d is None:
        left.append((src, r))
        continue
      d.free -= pages  # reserved for the copy; the request holds them once it lands
      d.scheduler.expect(r)
      r.transfer_bytes += pages * self.cluster.page_size * self.cluster.kv_bytes_per_token
      started.append((now + self.cluster.transfer_time(r.computed), src, d, r))
    self.handoff = left
    return started

  def land(self, src: _Worker, d: _Worker, r: SimRequest) -> None:
    src.scheduler.remove(r)  # frees its pages on the prefill worker
    r.pages = math.ceil(r.computed / self.cluster.page_size)  # those reserved on d
    d.scheduler.join(r)

  def after_step(self, w: _Worker, out: list[SimRequest]) -> None:
    for r in out:
      if r.finish_time is None:  # parked on a prefill worker
        self.handoff.append((w, r))

  def run_events(self, reqs: list[SimRequest]) -> None:
    """Every worker on its own clock: a step starts when the previous ends and there is work."""
    events: list = []  # (time, order, kind, payload)
    order = 0

    def push(t, kind, payload):
      nonlocal order
      heapq.heappush(events, (t, order, kind, payload))
      order += 1

    for r in reqs:
      push(r.arrival, "arrive", r)
    pending_land: dict[_Worker, list] = collections.defaultdict(list)
    while events:
      now = events[0][0]
      while events and events[0][0] == now:  # everything at this instant, before any new step
        _, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
          self.route(payload)
        elif kind == "step":
          w, plan = payload
          w.busy_until = None
          if w.kind == "decode":  # copies that landed during the step join at its boundary
            for src, r in pending_land.pop(w, []):
              self.land(src, w, r)
          self.after_step(w, w.apply(plan, now))
        elif kind == "land":
          src, d, r = payload
          if d.busy_until is None:
            self.land(src, d, r)
          else:
            pending_land[d].append((src, r))
        if not events or events[0][0] != now:
          for t, src, d, r in self.start_transfers(now):
            push(t, "land", (src, d, r))
      for w in self.entry + self.decode:
        if w.busy_until is None and w.scheduler.has_work():
          plan = w.scheduler.plan()
          if plan:
            w.busy_until = now + w.cost(plan)
            push(w.busy_until, "step", (w, plan))

  def run_lockstep(self, reqs: list[SimRequest]) -> None:
    """One host loop: each iteration steps every busy worker; copies land the next iteration."""
    queue = collections.deque(sorted(reqs, key=lambda r: r.arrival))
    now, landing, left = 0.0, [], len(reqs)
    workers = self.entry + self.decode
    while left:
      while queue and queue[0].arrival <= now:
        self.route(queue.popleft())
      plans = [(w, w.scheduler.plan()) for w in workers if w.scheduler.has_work()]
      plans = [(w, p) for w, p in plans if p]
      if not plans and not landing:
        if not queue:
          raise RuntimeError(f"{left} requests cannot be served: nothing runs and none can move")
        now = max(now, queue[0].arrival)
        continue
      host = [w.host_cost(p) for w, p in plans]
      device = [w.cost(p) - h for (w, p), h in zip(plans, host)] or [0.0]
      now += (
          sum(host)
          + max(max(device), sum(device) / self.cluster.cores)
          + self.cluster.iteration_overhead
      )
      for w, p in plans:
        out = w.apply(p, now)
        left -= sum(r.finish_time is not None for r in out)
        self.after_step(w, out)
      for t, src, d, r in landing:
        now = max(now, t)
        self.land(src, d, r)
      landing = self.start_transfers(now)
