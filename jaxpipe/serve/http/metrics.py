"""The server's Prometheus metrics: gauges of the batch and the KV pages, counters of tokens and
finishes, TTFT / TPOT / end-to-end histograms, and the process' CPU and memory, in a registry of
the server's own (so that two servers in one process, as in the tests, do not mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


class Metrics:
  """Prometheus metrics of one server (its own registry), and the process' own (CPU, memory)."""

  def __init__(self):
    r = self.registry = CollectorRegistry()
    ProcessCollector(registry=r)
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
