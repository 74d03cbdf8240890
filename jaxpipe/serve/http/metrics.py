"""The server's Prometheus metrics, in a registry of the server's own (so that two servers in one
process, as in the tests, do not mix).

Two families side by side:
- vLLM's (`vllm:*`), with vLLM's names, types, label names (`model_name`, `engine`; finishes by
  `finished_reason`) and histogram buckets, as its v1 `PrometheusStatLogger` exports them, so
  that dashboards and autoscalers made for vLLM read this server unchanged. The engine label is
  "0": a deployment of several engines reports their sums, as one engine would.
- jaxpipe's own (`jaxpipe_*`): the KV pages in detail, steps, KV slots and tokens summed over
  steps (serve_bench's KV figure), generated tokens per second, refusals by HTTP status, and the
  process' CPU and memory.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from jaxpipe.serve import slo

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ["model_name", "engine"]


def buckets_1_2_5(limit: int) -> list[int]:
  """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`.

  Args:
    limit: the largest value a bucket may have.

  Returns:
    The ascending buckets, none above `limit`.
  """
  out, base = [], 1
  while True:
    for m in (1, 2, 5):
      if m * base > limit:
        return out
      out.append(m * base)
    base *= 10


class VllmMetrics:
  """vLLM's metrics, each bound to this server's labels."""

  def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int):
    labels = {"model_name": model_name, "engine": "0"}

    def make(cls, name, doc, **kw):
      return cls(name, doc, LABELS, registry=r, **kw).labels(**labels)

    self.running = make(
        Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
    )
    self.waiting = make(
        Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
    )
    self.kv_usage = make(
        Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
    )
    self.prefix_queries = make(
        Counter,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    )
    self.prefix_hits = make(
        Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
    )
    self.preemptions = make(
        Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
    )
    self.spec_drafts = make(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
    self.spec_accepted = make(
        Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
    )
    self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
    self.generation_tokens = make(
        Counter, "vllm:generation_tokens", "Number of generation tokens processed."
    )
    self._success = Counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        LABELS + ["finished_reason"],
        registry=r,
    )
    self._labels = labels
    for reason in ("stop", "length", "abort"):
      self.success(reason)  # present at 0, as vLLM's
    counts = buckets_1_2_5(max_model_len)
    self.request_prompt_tokens = make(
        Histogram,
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        buckets=counts,
    )
    self.request_generation_tokens = make(
        Histogram,
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        buckets=counts,
    )
    self.ttft = make(
        Histogram,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        buckets=TTFT_BUCKETS,
    )
    self.itl = make(
        Histogram,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        buckets=TOKEN_LATENCY_BUCKETS,
    )
    self.tpot = make(
        Histogram,
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        buckets=TOKEN_LATENCY_BUCKETS,
    )
    self.request_tpot = make(
        Histogram,
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        buckets=TOKEN_LATENCY_BUCKETS,
    )
    self.e2e = make(
        Histogram,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        buckets=REQUEST_LATENCY_BUCKETS,
    )

  def success(self, reason: str):
    """The vllm:request_success counter for one finish reason.

    Args:
      reason: the finish reason label.

    Returns:
      The counter bound to this server's labels and the reason.
    """
    return self._success.labels(**self._labels, finished_reason=reason)


class Metrics:
  """Prometheus metrics of one server (its own registry), and the process' own (CPU, memory)."""

  def __init__(self, model_name: str = "", max_model_len: int = 2048):
    r = self.registry = CollectorRegistry()
    ProcessCollector(registry=r)
    self.vllm = VllmMetrics(r, model_name, max_model_len)
    self._engine_counts = dict.fromkeys(
        ("preemptions", "prefix_hits", "spec_drafts", "spec_accepted"), 0
    )
    self.running = Gauge(
        "jaxpipe_num_requests_running", "Sequences in the running batch.", registry=r
    )
    self.waiting = Gauge(
        "jaxpipe_num_requests_waiting", "Sequences accepted, not yet running.", registry=r
    )
    self.pages_total = Gauge(
        "jaxpipe_kv_pages_total", "KV pages per layer (not the scratch page).", registry=r
    )
    self.pages_used = Gauge(
        "jaxpipe_kv_pages_used",
        "KV pages allocated, to sequences or the prefix cache.",
        registry=r,
    )
    self.pages_running = Gauge(
        "jaxpipe_kv_pages_running", "KV pages held by running sequences.", registry=r
    )
    self.pages_cached = Gauge(
        "jaxpipe_kv_pages_cached", "KV pages in the prefix cache.", registry=r
    )
    self.kv_tokens = Counter(
        "jaxpipe_kv_tokens_stored",
        "Tokens stored for running sequences, summed over steps.",
        registry=r,
    )
    self.kv_slots = Counter(
        "jaxpipe_kv_slots_held",
        "KV slots of the pages running sequences hold, summed over steps.",
        registry=r,
    )
    self.steps = Counter(
        "jaxpipe_engine_steps", "Engine iterations that ran the model.", registry=r
    )
    self.prompt_tokens = Counter("jaxpipe_prompt_tokens", "Prompt tokens accepted.", registry=r)
    self.generation_tokens = Counter("jaxpipe_generation_tokens", "Tokens generated.", registry=r)
    self.tokens_per_second = Gauge(
        "jaxpipe_generation_tokens_per_second",
        "Tokens generated per second over the last 10 s.",
        registry=r,
    )
    self.ttft = Histogram(
        "jaxpipe_time_to_first_token_seconds",
        "Arrival to first token.",
        buckets=(
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1,
            2.5,
            5,
            7.5,
            10,
            20,
            40,
            80,
        ),
        registry=r,
    )
    self.tpot = Histogram(
        "jaxpipe_time_per_output_token_seconds",
        "A sequence's mean time per output token after the first.",
        buckets=(
            0.001,
            0.0025,
            0.005,
            0.01,
            0.025,
            0.05,
            0.075,
            0.1,
            0.15,
            0.2,
            0.3,
            0.4,
            0.5,
            0.75,
            1,
            2.5,
        ),
        registry=r,
    )
    self.e2e = Histogram(
        "jaxpipe_e2e_request_latency_seconds",
        "Arrival to last token.",
        buckets=(0.1, 0.3, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
        registry=r,
    )
    self.finished = Counter(
        "jaxpipe_request_finished", "Sequences finished, by reason.", ["finish_reason"], registry=r
    )
    self.rejected = Counter(
        "jaxpipe_request_rejected", "Requests refused, by HTTP status.", ["status"], registry=r
    )

  def accepted(self, s) -> None:
    """A sequence was handed to the engine.

    Args:
      s: the `loop.Seq`; its prompt's tokens are counted (and looked up in the prefix cache when it
        generates).
    """
    self.prompt_tokens.inc(len(s.prompt))
    self.vllm.prompt_tokens.inc(len(s.prompt))
    if s.max_tokens > 0:  # the engine looks its prompt up in the prefix cache
      self.vllm.prefix_queries.inc(len(s.prompt))

  def generated(self, n: int) -> None:
    """Counts generated tokens.

    Args:
      n: tokens generated.
    """
    self.generation_tokens.inc(n)
    self.vllm.generation_tokens.inc(n)

  def observe_gaps(self, seconds: float, n: int) -> None:
    """n tokens of one sequence came `seconds` after its previous ones.

    Args:
      seconds: since the sequence's previous tokens.
      n: tokens that came; each is observed at seconds / n.
    """
    for _ in range(n):
      self.vllm.itl.observe(seconds / n)
      self.vllm.tpot.observe(seconds / n)

  def finish(self, s, reason: str, now: float) -> None:
    """A sequence finished.

    Args:
      s: the `loop.Seq`, with its arrival, first and last token times and token count.
      reason: OpenAI's finish_reason, or "error".
      now: the time (`time.perf_counter`), the end of a sequence with no token.
    """
    self.finished.labels(reason).inc()
    self.vllm.success(reason).inc()
    self.vllm.request_prompt_tokens.observe(len(s.prompt))
    self.vllm.request_generation_tokens.observe(s.n_tokens)
    self.vllm.e2e.observe((s.last or now) - s.arrival)
    if s.first is not None:
      self.ttft.observe(slo.ttft(s.arrival, s.first))
      self.vllm.ttft.observe(slo.ttft(s.arrival, s.first))
      self.e2e.observe(s.last - s.arrival)
    tpot = slo.tpot(s.first, s.last, s.n_tokens)
    if tpot is not None:
      self.tpot.observe(tpot)
      self.vllm.request_tpot.observe(tpot)

  def engines(self, load: dict) -> None:
    """Gauges and engine counters after a loop iteration.

    Args:
      load: what the backend holds (`loop.load_of`): requests running, waiting and incoming,
        its summed `kv_usage` (pages_held, pages_total) and `Engine.counts`.
    """
    v = self.vllm
    v.running.set(load["running"])
    # vLLM's decode instance keeps a request whose K/V is on its way in its waiting queue
    # (WAITING_FOR_REMOTE_KVS); a prefill instance's finished prefill is in neither
    v.waiting.set(load["waiting"] + load["incoming"])
    # vLLM counts a cached page no request holds as free (its pool evicts it on demand)
    usage = load["usage"]
    v.kv_usage.set(usage.get("pages_held", 0) / max(usage.get("pages_total", 0), 1))
    for key, counter in (
        ("preemptions", v.preemptions),
        ("prefix_hits", v.prefix_hits),
        ("spec_drafts", v.spec_drafts),
        ("spec_accepted", v.spec_accepted),
    ):
      total = load["counts"].get(key, 0)
      if total > self._engine_counts[key]:
        counter.inc(total - self._engine_counts[key])
      self._engine_counts[key] = total
