"""Continuous-batching engine over a paged KV cache (iteration-level scheduling, as Orca and vLLM).

The host owns the requests, the page allocator and the prefix cache; the devices own the pools
and run one compiled step per iteration. Each `step()`:

1. schedules under a token budget (`serve.scheduler.Scheduler`, the one the simulator runs
   too): running requests first, oldest first (a decode token each, or the next chunk of a
   prompt), then waiting requests while the batch, the budget and the free pages allow (a new
   prompt first takes what the prefix cache holds of it);
2. gives every scheduled request the pages its new tokens go to, copying a shared page before
   writing into it (the engine's side of the scheduler: `_EnginePages`); when none is free, the
   newest running request is preempted: its pages are freed and it waits again at the head of
   the queue, to be recomputed from its tokens;
3. runs the model once over all scheduled tokens (the step's arrays are `serve.batch`'s, padded
   to a bucket of tokens and of pages per sequence, so the number of compiled programs is
   bounded: `programs`) and samples a token for every request whose tokens are all cached;
4. finishes requests on EOS or `max_tokens`, freeing their pages at once.

The engine's parts, one module each: a request's fields and states (`serve.request`), the
scheduler (`serve.scheduler`), the page allocator and prefix cache (`serve.pages`), building a
step's token batch (`serve.batch`), the compiled step programs (`serve.programs`), scoring a
prompt (`serve.scoring`) and moving a request's K/V between engines (`serve.kv_transfer`,
`Engine.transfer`). This module holds the request lifecycle and the step.

Bad requests (empty prompt, tokens outside the vocabulary, too long for the context or the pool,
bad sampling values) finish at once with an `error`; the engine keeps serving the others.
`fork` starts a second sample of a running request on shared pages; `transfer` moves a running
request, K/V included, to another engine.
Sliding-window layers keep a ring of pages per running sequence (`model.ring_pages`: its
window and a step's chunk), taken at admission from an allocator of their own and given back
with the request, so that they hold no page of the context outside it; full-attention layers
keep every page as before. Such a model serves without the prefix cache and K/V moves (a ring
holds the last positions only, which a prefix or another engine does not have).
`step` is `collect(launch())`: a driver of several engines launches all their steps before
collecting any, so that they run at once on their devices. With `async_scheduling`, `step`
schedules and dispatches step n+1 before it waits for step n (vLLM's async scheduling): the
host's work of a step overlaps the devices' work of the one before. Step n+1 is planned as if
every request sampled in step n had its token; the token itself goes from step n's output to
step n+1's input on the device (`TokenBatch.prev_T`), never through the host. A request that
stops on its step-n token (EOS, a stop token) was already given step n+1: that step's work for
it is dropped, as vLLM drops it. A step with grammar-constrained rows runs as two programs,
the model's and the sampling's: the host fills the rows' token masks between the two dispatches,
while the model runs, once step n's tokens have reached it. A `prefill_only` engine parks each
request once its first token is sampled (`prefilled`), pages kept, for a decode engine to take.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.ops.attention import resolve_step_backend
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.serve import batch as batch_lib
from jaxpipe.serve import grammar as grammar_lib
from jaxpipe.serve import model as model_lib
from jaxpipe.serve import sampling as sampling_lib
from jaxpipe.serve import speculative as speculative_lib
from jaxpipe.serve.batch import bucket
from jaxpipe.serve.kv_transfer import KVTransfer
from jaxpipe.serve.mtp_drafter import MtpDrafter, Span
from jaxpipe.serve.pages import PageAllocator, PrefixCache, page_key
from jaxpipe.serve.programs import StepPrograms
from jaxpipe.serve.refusal import Refusal
from jaxpipe.serve.request import (
    ENGINE_EOS,
    FINISHED,
    FINISHING,
    PENDING,
    PREFILLED,
    RUNNING,
    WAITING,
    Request,
    RequestLimits,
)
from jaxpipe.serve.sampling import (
    SamplingParams,
    TokenLogprobs,
    as_token_logprobs,
)
from jaxpipe.serve.scheduler import Scheduler
from jaxpipe.serve.scoring import Scorer

# Engine.host_time's keys, in a step's order: plan the step (scheduler, pages, copy-on-write);
# build its host arrays; compile a new step program; dispatch it; fill its grammars' token masks
# (while its model runs); wait for its sampled tokens (the device's time, less what dispatch
# overlapped); apply them (outputs, finishes, cache).
HOST_PHASES = ("schedule", "build", "compile", "dispatch", "mask", "wait", "apply")


@dataclasses.dataclass
class _Launched:
  """A step dispatched to the devices and not yet read back (`launch` -> `collect`)."""

  plan: list[tuple[Request, int]]
  sampled: list[Request]
  t: int  # padded tokens
  t_real: int
  index: list[int]  # per sampled row: the output index its token fills (a PENDING until then)
  pages: int  # padded pages per sequence
  new_R: jax.Array
  finite_R: jax.Array
  logprobs: tuple | None  # `sampling.top_logprobs` of the rows; None: no row wanted them
  drafted: list[int] | None = None  # a verify step's drafts per sampled row; None: no drafts
  # a step with constrained rows, until its sampling is dispatched (`Engine._sample`): (the
  # sampling program, the model's logits on the devices, the SamplingBatch, prev_R)
  sample: tuple | None = None
  # an MTP drafter's engine: the step's last hidden states [T, D] on the devices, and each plan
  # entry's first token index in the step and its position
  hidden: jax.Array | None = None
  spans: list[tuple[int, int]] | None = None


def _check_tensor_parallel(cfg: TransformerConfig, tp: int) -> None:
  """Raises ValueError (one line, the value and the fix) unless the model splits over tp
  devices as training's tensor parallelism does (`tp_lib.check`); the pools split the KV
  heads, so they must divide too (no replicated KV groups)."""
  if cfg.mla is not None and tp > 1:
    raise ValueError(
        f"this model uses latent attention (model.mla), which is not split over tensor-parallel "
        f"devices; serve it on one device, not {tp}"
    )
  tp_lib.check(
      tp=tp,
      n_heads=cfg.n_heads,
      n_kv_heads=cfg.n_kv_heads,
      d_ff=cfg.d_ff,
      vocab=cfg.vocab,
      seq_len=1,
      sequence_parallel=False,
      over=f"the engine's {tp} devices (tensor-parallel)",
      fix="give the engine a number of devices that divides {value}",
      kv_whole=False,
  )


class _EnginePages:
  """The engine's side of its `Scheduler` (`scheduler.Pages`): the reference-counted allocator,
  the prefix cache, and copy-on-write of a shared page before a request writes into it."""

  def __init__(self, engine: Engine):
    self.engine = engine

  @property
  def num_free(self) -> int:
    return self.engine.allocator.num_free

  def can_alloc(self, n: int) -> bool:
    return self.engine.allocator.can_alloc(n)

  def match_prefix(self, r: Request) -> bool:
    e = self.engine
    if e.prefix_cache is None:
      return False
    r.pages = e.prefix_cache.match(r.tokens)
    # The last token is always computed: its logits give the next token.
    r.computed = min(len(r.pages) * e.page_size, len(r.tokens) - 1)
    return True

  def reserve(self, r: Request, n: int) -> bool:
    e, s = self.engine, self.engine.page_size
    new = math.ceil((r.computed + n) / s) - len(r.pages)
    shared = [i for i in range(r.computed // s, len(r.pages)) if e.allocator.refs[r.pages[i]] > 1]
    if not e.allocator.can_alloc(new + len(shared)):
      return False
    if e.ring_size and not r.ring:  # its sliding layers' ring, for as long as it runs
      if not e.ring_allocator.can_alloc(e.ring_size):
        return False
      r.ring = [e.ring_allocator.alloc() for _ in range(e.ring_size)]
    for i in shared:
      page, source = e.allocator.writable(r.pages[i])
      e._copy_page(source, page)
      e.counts["page_copies"] += 1
      r.pages[i] = page
    r.pages += [e.allocator.alloc() for _ in range(new)]
    return True

  def release(self, r: Request) -> None:
    if r.pages:
      self.engine.allocator.free(r.pages)
      r.pages = []
    if r.ring:
      self.engine.ring_allocator.free(r.ring)
      r.ring = []


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """An engine's settings: its pool, its batch, its step's padding and its behaviour."""

  page_size: int = 16  # tokens per KV page
  num_pages: int = 256  # pages in the pool, the scratch page 0 included
  max_batch: int = 16  # running sequences at most (the sampled rows of a step)
  max_tokens_per_step: int = 256  # the scheduler's token budget per step
  max_seq_len: int = 2048  # prompt + generated tokens of one request at most
  attention: str = "auto"  # the step's attention backend (`ops.attention.resolve_step_backend`)
  # the GEMM of the step's projections and head (`ops.matmul`): 'auto' (oneDNN on a CPU where it
  # builds, else XLA's dot), 'onednn' or 'xla'
  matmul: str = "auto"
  # with oneDNN's GEMMs on one device, hold the projections and the head in its blocked layout
  # instead of row-major (`serve.model.prepack_params`): faster decode, the weights held once
  prepack_weights: bool = True
  eos_id: int | Sequence[int] | None = None  # the engine's EOS ids (add_request's default)
  prefix_caching: bool = True  # reuse the cached pages of shared prompt prefixes
  # padded sizes a step may take (tokens per step, pages per sequence); None: tokens
  # `batch.token_buckets` (powers of two from 8, half-steps from 64), pages powers of two; the
  # limits always included
  token_buckets: Sequence[int] | None = None
  page_buckets: Sequence[int] | None = None
  # pools start as NaN and every freed page is refilled with NaN (tests: a read of a slot a
  # sequence does not own would show in its output)
  nan_freed_pages: bool = False
  prefill_only: bool = False  # a prefill worker: a sampled request waits in `prefilled`, pages kept
  # 'auto' (the model's compute dtype), 'bfloat16', 'int8' or 'fp8' (float8_e4m3fn; the 8-bit
  # ones with a float32 scale per KV head and slot: `serve.model`)
  kv_cache_dtype: str = "auto"
  # a latent-attention model's pages: 'latent' (c_kv and the rotary key per token, decode
  # absorbed) or 'expanded' (every head's K and V); `serve.model.cached_heads`
  mla_cache: str = "latent"
  # `step` dispatches the next step before waiting for this one (the module docstring); None:
  # on, except on a prefill_only or speculating engine
  async_scheduling: bool | None = None
  # draft tokens verified in the step (`serve.speculative`); None: one token per step
  speculative: speculative_lib.SpecConfig | None = None

  def __post_init__(self):
    for name in ("page_size", "num_pages", "max_batch", "max_tokens_per_step", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if self.num_pages < 2:
      raise ValueError(f"num_pages={self.num_pages} must be >= 2: page 0 is the scratch page")
    model_lib.check_mla_cache(self.mla_cache)
    if self.async_scheduling and self.prefill_only:
      raise ValueError(
          "async_scheduling=True with prefill_only=True: a prefill worker parks each request at "
          "its first token, which async scheduling would already have given a decode step; "
          "leave async_scheduling off on prefill workers"
      )
    if self.async_scheduling and self.speculative is not None:
      raise ValueError(
          "async_scheduling=True with speculative decoding: the tokens a verify step emits "
          "decide where the next step starts; leave async_scheduling off (its default here)"
      )


class Engine:
  """Serves one model from a paged KV cache on `devices` (default: the first device).

  With several devices the model runs tensor-parallel over them, Megatron's layout as in
  training (`jaxpipe.parallel.tensor`): each holds its share of the attention heads (KV heads
  included, with their pages), of d_ff and of the vocabulary, so n_heads, n_kv_heads, d_ff and
  the vocabulary must divide by their count; experts and norms are whole on each. Two engines
  on disjoint devices are independent. A model with sliding-window layers keeps rings of pages
  for them (the module docstring).
  """

  def __init__(
      self,
      model_cfg: TransformerConfig,
      params: dict,
      config: EngineConfig | None = None,
      *,
      devices: Sequence[jax.Device] | None = None,
      **fields,
  ):
    """Places the parameters and the page pools on `devices`.

    Args:
      model_cfg: the model.
      params: its parameters (`transformer.init_params`'s tree). On CPU the engine keeps each
        layer's weights as arrays of their own (`serve.model.unstack_layers`: a copy; drop yours
        to hold the weights once).
      config: the engine's settings (default `EngineConfig()`).
      devices: the engine's devices (default: the first device); several run the model
        tensor-parallel.
      **fields: `EngineConfig` fields that replace the config's (`Engine(cfg, params,
        max_batch=8)`).
    """
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
      raise TypeError(f"Engine got unknown settings {unknown}; EngineConfig's fields are {names}")
    self.config = config = dataclasses.replace(config or EngineConfig(), **fields)
    page_size, num_pages, max_batch = config.page_size, config.num_pages, config.max_batch
    max_tokens_per_step, max_seq_len = config.max_tokens_per_step, config.max_seq_len
    kv_cache_dtype, prefill_only = config.kv_cache_dtype, config.prefill_only
    self.kv_cache_dtype = kv_cache_dtype
    self.kv_dtype = model_lib.kv_dtype(model_cfg, kv_cache_dtype)  # refuses another name
    quantized = model_lib.quantized(self.kv_dtype)
    devices = list(devices) if devices is not None else jax.devices()[:1]
    _check_tensor_parallel(model_cfg, len(devices))
    self.cfg = model_lib.serving_config(model_cfg)
    max_pages_per_seq = math.ceil(max_seq_len / page_size)
    # sliding-window layers: a ring of pages per running sequence, where it is shorter than the
    # context (model.ring_pages); none, or every layer keeps every page
    rings = model_lib.ring_layers(self.cfg)
    ring = model_lib.ring_pages(self.cfg, page_size, max_tokens_per_step) if rings else 0
    self.ring_size = ring if 0 < ring < max_pages_per_seq else 0
    window_pages = 1 + max_batch * self.ring_size if self.ring_size else 0
    if self.ring_size and len(rings) == self.cfg.n_layers:
      # no layer keeps the context: its pages are bookkeeping of no bytes, as many as could run
      num_pages = max(num_pages, 1 + max_batch * max_pages_per_seq)
    prefix_caching = config.prefix_caching and not self.ring_size
    self.page_size, self.num_pages, self.max_batch = page_size, num_pages, max_batch
    self.max_tokens_per_step, self.max_seq_len = max_tokens_per_step, max_seq_len
    self.eos_id = config.eos_id
    self.limits = RequestLimits(model_cfg.vocab, max_seq_len, page_size, num_pages, config.eos_id)
    # (heads, key width, value width) of what a layer's pages hold per token
    self.cached = model_lib.cached_heads(model_cfg, config.mla_cache)
    self.backend = resolve_step_backend(config.attention, self.cached[1], page_size, self.kv_dtype)
    self.matmul = matmul_lib.resolve(config.matmul)
    self.max_pages_per_seq = max_pages_per_seq
    self.token_buckets = batch_lib.check_buckets(
        "token_buckets",
        config.token_buckets,
        max_tokens_per_step,
        batch_lib.token_buckets(max_tokens_per_step),
    )
    self.page_buckets = batch_lib.check_buckets(
        "page_buckets",
        config.page_buckets,
        self.max_pages_per_seq,
        batch_lib.powers_of_two(self.max_pages_per_seq),
    )
    self._batch_shape = batch_lib.BatchShape(
        page_size,
        max_batch,
        self.token_buckets,
        self.page_buckets,
        self.ring_size,
        per_token=self.backend not in model_lib.RAGGED_BACKENDS,  # only these read tables_TxN
        spec_tokens=config.speculative.num_tokens if config.speculative else 0,
    )
    self.mesh = Mesh(np.array(devices), (model_lib.KV_AXIS,))
    self._replicated = NamedSharding(self.mesh, P())
    self.pool_sharding = NamedSharding(self.mesh, P(model_lib.KV_AXIS))
    scales = self.pool_sharding if quantized else None
    self.kv_cache_sharding = model_lib.KVPages(
        self.pool_sharding,
        self.pool_sharding,
        num_pages,
        scales,
        scales,
        window_pages,
        rings if self.ring_size else (),
    )
    prepack = config.prepack_weights and self.matmul == "onednn" and len(devices) == 1
    if devices[0].platform == "cpu" and not prepack:  # each layer read in place (unstacked)
      params = model_lib.unstack_layers(params)
    # Megatron's tensor-parallel layout over the engine's devices (`model_lib.forward_paged`)
    self._param_sharding = jax.tree.map(
        lambda spec: NamedSharding(self.mesh, spec),
        model_lib.param_specs(params, len(devices)),
        is_leaf=lambda x: isinstance(x, P),
    )
    self.params = jax.device_put(params, self._param_sharding)
    if prepack:  # the projections and head in oneDNN's layout, the layers unstacked one by one
      self.params = model_lib.prepack_params(self.cfg, self.params)
      self._param_sharding = jax.tree.map(lambda _: self._replicated, self.params)
      self.params = jax.device_put(self.params, self._param_sharding)
    self.nan_freed_pages = nan_freed_pages = config.nan_freed_pages
    self.kv = model_lib.init_kv(
        self.cfg,
        num_pages,
        page_size,
        fill=float("nan") if nan_freed_pages else 0.0,
        sharding=self.pool_sharding,
        kv_cache_dtype=kv_cache_dtype,
        window_pages=window_pages,
        mla_cache=config.mla_cache,
    )
    self._to_fill: list[int] = []
    self._to_fill_ring: list[int] = []
    self.allocator = PageAllocator(
        num_pages, on_free=self._to_fill.append if nan_freed_pages else None
    )
    self.ring_allocator = None
    if self.ring_size:
      self.ring_allocator = PageAllocator(
          window_pages, on_free=self._to_fill_ring.append if nan_freed_pages else None
      )
    self.prefix_cache = PrefixCache(self.allocator, page_size) if prefix_caching else None
    self.requests: dict[int, Request] = {}
    self.scheduler: Scheduler[Request] = Scheduler(
        _EnginePages(self),
        max_batch=max_batch,
        token_budget=max_tokens_per_step,
        on_admit=self._admitted,
        on_preempt=self._preempted,
    )
    self.prefill_only = prefill_only
    self.speculative = config.speculative
    self._drafter = None
    if config.speculative is not None and config.speculative.method == "mtp":
      if len(devices) > 1:
        raise ValueError(
            f"speculative method 'mtp' runs on one device, not the {len(devices)} given; serve "
            "on one, or use method 'ngram'"
        )
      k = config.speculative.num_tokens
      self._drafter = MtpDrafter(
          self.cfg,
          self.params,
          k,
          num_pages=num_pages + max_batch * (math.ceil(k / page_size) + 1),
          page_size=page_size,
          max_batch=max_batch,
          max_seq_len=max_seq_len,
          backend=self.backend,
          sharding=self.pool_sharding,
          mla_cache=config.mla_cache,
      )
    elif config.speculative is not None:
      self._drafter = speculative_lib.drafter_of(config.speculative)
    self.async_scheduling = (
        not prefill_only and config.speculative is None
        if config.async_scheduling is None
        else config.async_scheduling
    )
    self._inflight: _Launched | None = None  # async: the step dispatched and not collected yet
    self._early: dict[int, list[int]] = {}  # tokens collected early (`_drain`), for step()
    # the previous step's sampled tokens on the devices (async: what step n+1 reads step n's
    # tokens from); zeros before the first step
    self._no_prev = jax.device_put(np.zeros(max_batch, np.int32), self._replicated)
    self._finished: list[Request] = []
    self._next_id = 0
    self.compiled = StepPrograms(
        self.cfg,
        self.backend,
        self.matmul,
        self.mesh,
        max_batch,
        (self._param_sharding, self.kv_cache_sharding, self._replicated),
        ring=bool(self.ring_size),
        hidden=isinstance(self._drafter, MtpDrafter),
    )
    self.scorer = Scorer(self.cfg, self._param_sharding, self._replicated, max_seq_len)
    self.transfer = KVTransfer(self)
    self.steps = 0
    self.counts = collections.Counter()  # preemptions, page_copies, cached_tokens, tokens, ...
    # Seconds of wall time per phase of step(), summed over steps (`HOST_PHASES`): what the host
    # costs beside the device's work ("wait").
    self.host_time: collections.Counter[str] = collections.Counter()

  # The scheduler's queues, by the names the engine has always had.

  @property
  def waiting(self) -> collections.deque[Request]:
    """Requests waiting to be admitted, in order (a preempted one first)."""
    return self.scheduler.waiting

  @property
  def running(self) -> list[Request]:
    """The batch, oldest first."""
    return self.scheduler.running

  @property
  def prefilled(self) -> list[Request]:
    """prefill_only: requests waiting to be moved, pages kept (oldest first)."""
    return self.scheduler.parked

  @property
  def incoming(self) -> list[Request]:
    """Requests reserved for K/V on its way (`KVTransfer.reserve_request`), batch slots held."""
    return self.scheduler.incoming

  # -- requests ---------------------------------------------------------------------------------

  def check_request(
      self,
      prompt: Sequence[int],
      max_tokens: int,
      sampling: SamplingParams,
      eos_id: int | Sequence[int] | None | str = ENGINE_EOS,
  ) -> Refusal | None:
    """Why this request cannot be served, or None.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: the request's sampling values.
      eos_id: as `add_request` takes it (ENGINE_EOS: the engine's own).

    Returns:
      None, or a `Refusal`: one line naming the fix, with the request field at fault in
      `.param` (`max_tokens`, `prompt`, `stop_token_ids`, `min_tokens` or a sampling field).
    """
    return self.limits.check(prompt, max_tokens, sampling, eos_id)

  def add_request(
      self,
      prompt: Sequence[int],
      max_tokens: int = 16,
      sampling: SamplingParams | None = None,
      *,
      eos_id: int | Sequence[int] | None | str = ENGINE_EOS,
  ) -> int:
    """Queues a request; a bad one (`check_request`) is finished at once with `error` set.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: its sampling values (default: greedy).
      eos_id: the token (or tokens) that end it, kept in its output; None: only max_tokens and
        sampling.stop_token_ids do. Neither can be sampled before sampling.min_tokens tokens.
        Default: the engine's `EngineConfig.eos_id`.

    Returns:
      The request's id (`step`'s keys, `finished()`'s `.id`).
    """
    sampling = sampling or SamplingParams()
    rid = self.new_id()
    r = Request(
        rid,
        [int(t) if isinstance(t, (int, np.integer)) else t for t in prompt],
        max_tokens,
        sampling,
        self.eos_id if eos_id == ENGINE_EOS else eos_id,
        arrival=time.perf_counter(),
    )
    self.requests[rid] = r
    error = self.check_request(r.prompt, max_tokens, sampling, r.eos_id)
    if error:
      r.error = error
      self._finish(r, "error")
    else:
      if sampling.guide is not None:
        r.grammar = sampling.guide.matcher()
      self.scheduler.add(r)
    return rid

  def _detach(self, r: Request) -> bool:
    """Takes r off the scheduler, its pages freed at once; False if it is finished."""
    if r.state == FINISHED:
      return False
    self.scheduler.remove(r)
    self.transfer.forget(r.id)
    return True

  def _request(self, rid: int) -> Request:
    """The request `rid` -> KeyError naming it and why this engine holds none by that id."""
    r = self.requests.get(rid)
    if r is None:
      if 0 <= rid < self._next_id:
        why = "it finished and `finished()` returned it, or it was released"
      else:
        why = f"this engine never gave that id (its ids so far: 0 to {self._next_id - 1})"
      raise KeyError(f"no request {rid}: {why}")
    return r

  def cancel(self, rid: int) -> None:
    """Stops a request now; its pages are freed at once. A finished request is left as it is,
    also one that `finished()` has returned (a client that leaves after its last token).

    Args:
      rid: the request's id.

    Raises:
      KeyError: this engine never gave that id.
    """
    if rid not in self.requests and 0 <= rid < self._next_id:
      return
    r = self._request(rid)
    if self._detach(r):
      self._finish(r, "cancelled")

  def release(self, rid: int) -> None:
    """Drops a request that continues on another engine: frees its pages; `finished` omits it.

    Args:
      rid: the request's id.

    Raises:
      ValueError: the request is finished; there is nothing to release.
      KeyError: no request by that id (never given, or returned by `finished()`).
    """
    self.drain()
    r = self._request(rid)
    del self.requests[rid]
    if not self._detach(r):
      raise ValueError(f"request {rid} is finished; there is nothing to release")
    r.state = FINISHED

  def rewind(self, rid: int, output: Sequence[int]) -> None:
    """Replaces a running or parked request's output; the cached K/V of the tokens the old and
    the new share stay, the rest are recomputed when it next runs (a drafter's rejected drafts).

    Args:
      rid: the request's id.
      output: its new output tokens.

    Raises:
      ValueError: the request is finished or not yet admitted.
      KeyError: no request by that id (never given, or returned by `finished()`).
    """
    self.drain()
    r = self._request(rid)
    if r.state not in (RUNNING, PREFILLED):
      raise ValueError(f"request {rid} is {r.state}; only a running or parked one can rewind")
    new = r.prompt + list(output)
    common = next((i for i, (a, b) in enumerate(zip(r.tokens, new)) if a != b), None)
    common = min(len(r.tokens), len(new)) if common is None else common
    r.output = list(output)
    r.computed = min(r.computed, common, len(new) - 1)
    self._free_past_computed(r)
    r.page_keys = r.page_keys[: r.computed // self.page_size]
    r.registered = min(r.registered, len(r.page_keys))

  def _free_past_computed(self, r: Request) -> None:
    """Frees r's pages past those its computed tokens fill."""
    held = math.ceil(r.computed / self.page_size)
    if len(r.pages) > held:
      self.allocator.free(r.pages[held:])
      r.pages = r.pages[:held]

  def pause(self, rid: int) -> None:
    """Takes a running request out of the batch, its pages kept, until `resume`.

    Args:
      rid: the request's id.

    Raises:
      KeyError: no request by that id (never given, or returned by `finished()`).
    """
    self.drain()
    r = self._request(rid)
    self.scheduler.park(r)
    r.state = PREFILLED

  def resume(self, rid: int) -> None:
    """Puts a paused request back into the batch.

    Args:
      rid: the request's id.

    Raises:
      ValueError: the batch is full.
      KeyError: no request by that id (never given, or returned by `finished()`).
    """
    r = self._request(rid)
    if not self.scheduler.has_slot():
      raise ValueError(f"the batch is full ({self.max_batch} running requests); resume later")
    self.scheduler.parked.remove(r)
    self.scheduler.join(r)
    r.state = RUNNING

  def fork(self, rid: int, sampling: SamplingParams | None = None) -> int:
    """A second sample of a running request.

    It continues from the same tokens, sharing every page (copied when either writes into a
    shared one); sliding-window rings are copied.

    Args:
      rid: the running request's id.
      sampling: the fork's sampling; None: the request's own.

    Returns:
      The new request's id.

    Raises:
      ValueError: the request is not running, the batch is full, the sampling is refused, it asks
        for log-probabilities the request's tokens so far lack, or no ring pages are free.
      KeyError: no request by that id (never given, or returned by `finished()`).
    """
    self.drain()
    r = self._request(rid)
    if r.state != RUNNING:
      raise ValueError(f"request {rid} is {r.state}; only a running request can be forked")
    if not self.scheduler.has_slot():
      raise ValueError(f"the batch is full ({self.max_batch} running requests); fork later")
    sampling = sampling or r.sampling
    reason = sampling.check()
    if reason:
      raise ValueError(reason)
    if sampling.logprobs is not None and r.sampling.logprobs is None and r.output:
      raise ValueError(
          f"request {rid} has {len(r.output)} tokens without log-probabilities; a fork cannot "
          "have them for those: fork with the request's own sampling.logprobs"
      )
    ring = []
    if self.ring_size:  # a ring is written in place: the fork's is a copy
      if not self.ring_allocator.can_alloc(self.ring_size):
        raise ValueError("no free ring pages for the sliding-window layers; fork later")
      ring = [self.ring_allocator.alloc() for _ in range(self.ring_size)]
      for src, dst in zip(r.ring, ring):
        self._copy_page(src, dst, ring=True)
    new = dataclasses.replace(
        r,
        id=self.new_id(),
        sampling=sampling,
        output=list(r.output),
        logprobs=list(r.logprobs),
        pages=self.allocator.fork(r.pages),
        ring=ring,
        grammar=None if r.grammar is None else r.grammar.copy(),
        token_times=list(r.token_times),
        page_keys=list(r.page_keys),
        cached_tokens=0,
        preemptions=0,
    )
    self.requests[new.id] = new
    self.scheduler.join(new)
    return new.id

  def new_id(self) -> int:
    """A fresh request id."""
    self._next_id += 1
    return self._next_id - 1

  def finished(self) -> list[Request]:
    """Requests finished since the last call (they leave `requests`)."""
    done, self._finished = self._finished, []
    for r in done:
      self.requests.pop(r.id, None)
    return done

  def has_work(self) -> bool:
    """Whether a step would compute anything (parked and incoming requests do not), or a step is
    in flight (async scheduling)."""
    return self._inflight is not None or bool(self._early) or self.scheduler.has_work()

  def _finish(self, r: Request, reason: str) -> None:
    """r, already off the scheduler (its pages freed) or never on it, is done; output tokens
    still PENDING (steps in flight) are dropped."""
    while r.output and r.output[-1] == PENDING:
      r.output.pop()
    r.state, r.finish_reason, r.finish_time = FINISHED, reason, time.perf_counter()
    self._finished.append(r)
    if self._drafter is not None:
      self._drafter.forget(r.id)

  # -- the scheduler's callbacks ----------------------------------------------------------------

  def _admitted(self, r: Request) -> None:
    """A waiting request joined the batch; r.computed is what the prefix cache gave it."""
    r.state = RUNNING
    r.cached_tokens += r.computed
    self.counts["cached_tokens"] += r.computed
    if not r.preemptions:  # vLLM's hits: a preempted request's re-lookup is counted apart
      self.counts["prefix_hits"] += r.computed

  def _preempted(self, r: Request) -> None:
    """Recompute preemption freed r's pages; its full pages are offered to the cache again."""
    r.registered, r.state = 0, WAITING
    self.counts["preemptions"] += 1

  # -- device work ------------------------------------------------------------------------------

  def _layer_pages(self, ring: bool) -> np.ndarray:
    """The first page of each full-attention layer (ring: of each ring layer) in the pools."""
    layout = self.kv.layout
    return layout.offsets[layout.ring == ring]

  @functools.cached_property
  def _copy_fn(self):
    def copy(kv, firsts_L, src, dst):  # one page in each listed layer's pool (and scales)
      pools = jax.tree.map(lambda x: x.at[:, firsts_L + dst].set(x[:, firsts_L + src]), kv.pools)
      return kv.with_pools(*pools)

    return jax.jit(copy, donate_argnums=0, out_shardings=self.kv_cache_sharding)

  @functools.cached_property
  def _fill_fn(self):
    def fill(kv, firsts_L, pages_F, size):  # NaN into the listed pages of the listed layers;
      # entries of `size` or more (padding) drop
      idx = (firsts_L[:, None] + pages_F[None, :]).reshape(-1)
      idx = jnp.where(jnp.tile(pages_F, firsts_L.shape[0]) < size, idx, kv.k.shape[1])
      nan_of = lambda x: model_lib.NAN_BITS if x.dtype == model_lib.BITS else jnp.nan
      nan = lambda x: x.at[:, idx].set(nan_of(x), mode="drop")
      if kv.k_scales is not None:  # 8-bit: a NaN scale makes the slot's value NaN
        return kv.replace(k_scales=nan(kv.k_scales), v_scales=nan(kv.v_scales))
      return kv.with_pools(nan(kv.k), nan(kv.v))

    return jax.jit(fill, donate_argnums=0, out_shardings=self.kv_cache_sharding)

  def _copy_page(self, src: int, dst: int, ring: bool = False) -> None:
    self.flush_fills()
    firsts = self._layer_pages(ring)
    self.kv = self._copy_fn(self.kv, firsts, np.int32(src), np.int32(dst))

  def flush_fills(self) -> None:
    for ring, freed, size in (
        (False, self._to_fill, self.num_pages),
        (True, self._to_fill_ring, self.kv.window_pages),
    ):
      if freed:
        fill = set(freed)  # a page freed, taken and freed again before a step: once
        pages = np.full(size, size, np.int32)
        pages[: len(fill)] = sorted(fill)
        freed.clear()
        firsts = self._layer_pages(ring)
        self.kv = self._fill_fn(self.kv, firsts, pages, np.int32(size))

  def step_program(
      self, t: int, n: int, controls: tuple | None = None, logprobs: bool = False
  ) -> jax.stages.Compiled:
    """The compiled step for t tokens and n pages per sequence (`StepPrograms.get`).

    Args:
      t: the token bucket.
      n: the page bucket.
      controls: the step's `sampling.controls_key`; None: no optional sampling controls.
      logprobs: the variant that computes log-probabilities (a row of the step wants them).

    Returns:
      The compiled program (compiled on first use).
    """
    return self.compiled.get(t, n, self.params, self.kv, controls, logprobs)

  @property
  def programs(self) -> list[tuple[int, int]]:
    """(tokens, pages per sequence) of every step program compiled so far."""
    return self.compiled.shapes

  @property
  def max_programs(self) -> int:
    """The bound on `programs`: token buckets x page buckets."""
    return len(self.token_buckets) * len(self.page_buckets)

  def precompile(
      self, max_pages: int | None = None, move_pages: int = 0, per_layer: bool = False
  ) -> None:
    """Compiles the step programs and the K/V moves a run will need.

    Args:
      max_pages: every step program up to this many pages per sequence (default all).
      move_pages: the gather and write of every chunk of up to this many pages
        (`KVTransfer.precompile`), run on the scratch page.
      per_layer: those of one layer instead of all.
    """
    for n in self.page_buckets:
      if max_pages is None or n <= bucket(max_pages, self.page_buckets):
        for t in self.token_buckets:
          self.step_program(t, n)
    self.transfer.precompile(move_pages, per_layer)
    jax.block_until_ready(self.kv.k)

  def step(self) -> dict[int, list[int]]:
    """One iteration; returns the tokens each request generated in it (by request id).

    With async_scheduling the iteration whose tokens it returns is the one dispatched by the
    call before (or now, when none is in flight), and it leaves the next one in flight."""
    if not self.async_scheduling:
      self.drain()  # a step left in flight before async scheduling was turned off
      out, self._early = self._early, {}
      for rid, tokens in self.collect(self.launch()).items():
        out.setdefault(rid, []).extend(tokens)
      return out
    launched, self._inflight = self._inflight or self.launch(), None
    if launched is not None:
      self._inflight = self.launch(after=launched)  # while `launched` runs on the devices
      self._collect_early(launched)
      self._sample(self._inflight)  # its constrained rows' masks need `launched`'s tokens
    out, self._early = self._early, {}
    return out

  def drain(self) -> None:
    """Collects the step in flight (async scheduling), its tokens kept for the next `step`:
    what reads or moves a request's tokens or pages from outside a step calls it first."""
    launched, self._inflight = self._inflight, None
    if launched is not None:
      self._collect_early(launched)

  def _collect_early(self, launched: _Launched) -> None:
    """`collect`, its tokens added to those the next `step` returns."""
    for rid, tokens in self.collect(launched).items():
      self._early.setdefault(rid, []).extend(tokens)

  def launch(self, after: _Launched | None = None) -> _Launched | None:
    """Schedules an iteration and dispatches it without waiting for it.

    Args:
      after: the step still in flight (async scheduling), launched and not collected: the tokens
        it samples are PENDING in their requests' outputs, and this step takes them from its
        sampled tokens on the devices. None: no step in flight.

    Returns:
      The launched step, to `collect`; None: nothing to do.

    Raises:
      RuntimeError: a waiting request that cannot be admitted into an idle engine (which cannot
        happen for a checked request).
    """
    start = time.perf_counter()
    plan = self.scheduler.plan()
    planned = time.perf_counter()
    self.host_time["schedule"] += planned - start
    if not plan:
      held = self.prefilled or self.incoming  # their pages come back when they move on
      if self.waiting and not self.running and not held:  # cannot happen for a checked request
        raise RuntimeError(
            f"request {self.waiting[0].id} cannot be admitted into an idle engine "
            f"({self.allocator.num_free} free pages)"
        )
      return None
    after_rows = {} if after is None else {r.id: j for j, r in enumerate(after.sampled)}
    if self.speculative is not None:
      plan = self._propose(plan)
    step = batch_lib.build(plan, self._batch_shape, after_rows)
    drafted = [len(r.drafts) for r in step.sampled]
    for r, _ in plan:
      r.drafts = []
    self.flush_fills()
    built = time.perf_counter()
    key = sampling_lib.controls_key(step.sampling)
    wants = any(r.sampling.logprobs is not None for r in step.sampled)
    prev_R = self._no_prev if after is None else after.new_R
    new_R = finite_R = logprobs = sample = None
    if step.sampling.allowed_RxW is None:
      program = self.step_program(step.t, step.pages, key, wants)
      compiled = time.perf_counter()
      new_R, finite_R, logprobs, *hidden, self.kv = program(
          self.params, self.kv, step.tokens, step.sampling, prev_R
      )
    else:  # constrained rows: the model runs while the host fills their masks (`_sample`)
      forward, sample_program = self.compiled.get_split(
          step.t, step.pages, self.params, self.kv, key, wants
      )
      compiled = time.perf_counter()
      logits, *hidden, self.kv = forward(self.params, self.kv, step.tokens, prev_R)
      sample = (sample_program, logits, step.sampling, prev_R)
    spans = None
    if hidden:  # where each plan entry's tokens lie in the step, for the MTP drafter
      ats = np.cumsum([0] + [n for _, n in plan[:-1]]).tolist()
      spans = [(at, r.computed) for at, (r, _) in zip(ats, plan)]
    self.host_time["build"] += built - planned
    self.host_time["compile"] += compiled - built
    self.host_time["dispatch"] += time.perf_counter() - compiled
    # The host's view moves on at dispatch: the tokens' K/V are cached and each sampled request
    # has one more output token, PENDING until `collect` reads it, so that the next step can be
    # planned before this one is read back. A request whose last token this is leaves the
    # batch now: its pages are freed (and NaN-filled, in tests) after this step was dispatched,
    # so whatever takes them next runs after it.
    for r, n in plan:
      r.computed += n
    for r in step.sampled:
      r.output.append(PENDING)
      if len(r.output) >= r.max_tokens:
        self.scheduler.remove(r)
        r.state = FINISHING
    launched = _Launched(
        plan,
        step.sampled,
        step.t,
        step.t_real,
        step.index,
        step.pages,
        new_R,
        finite_R,
        logprobs,
        drafted if step.sampling.drafts_RxK is not None else None,
        sample,
        hidden[0] if hidden else None,
        spans,
    )
    if after is None:  # every constrained row's last token is on the host: sample now
      self._sample(launched)
    return launched

  def _sample(self, launched: _Launched | None) -> None:
    """Dispatches a launched step's sampling, once its constrained rows' last tokens are on the
    host: each row's grammar fills its mask (`grammar.fill_masks`) while the model runs. A row
    that finished on its token of the step before keeps an all-ones mask (its token is
    dropped)."""
    if launched is None or launched.sample is None:
      return
    start = time.perf_counter()
    program, logits, sampling, prev_R = launched.sample
    rows = [
        (j, r.grammar)
        for j, r in enumerate(launched.sampled)
        if r.grammar is not None and r.state != FINISHED and not r.grammar.done
    ]
    if rows:
      allowed = grammar_lib.fill_masks(rows, len(sampling.allowed_RxW), rows[0][1].vocab)
      sampling = dataclasses.replace(sampling, allowed_RxW=allowed)
    filled = time.perf_counter()
    launched.new_R, launched.finite_R, launched.logprobs = program(logits, sampling, prev_R)
    launched.sample = None
    self.host_time["mask"] += filled - start
    self.host_time["dispatch"] += time.perf_counter() - filled

  def _propose(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """Drafts for the plan's eligible decoding requests (`serve.speculative`), their pages
    reserved, within the step's token budget: the plan with each one's tokens grown by them."""
    k = self.speculative.num_tokens
    budget = self.max_tokens_per_step - sum(n for _, n in plan)
    asks = []
    for r, n in plan:
      left = min(k, r.max_tokens - len(r.output) - 1)
      decoding = n == 1 and r.computed + 1 == r.length
      plain = speculative_lib.eligible(
          r.sampling, len(r.output), r.sampling.logprobs is not None, r.grammar is not None
      )
      if left > 0 and decoding and plain:
        asks.append((r, left))
    proposed = self._drafter.propose([r for r, _ in asks], [m for _, m in asks]) if asks else []
    drafts = {r.id: d for (r, _), d in zip(asks, proposed)}
    out = []
    for r, n in plan:
      d = drafts.get(r.id, [])[:budget]
      if d and self.scheduler.pages.reserve(r, 1 + len(d)):
        r.drafts = d
        n += len(d)
        budget -= len(d)
      out.append((r, n))
    return out

  def collect(self, launched: _Launched | None) -> dict[int, list[int]]:
    """Waits for a launched iteration and applies it.

    Args:
      launched: what `launch` returned; None: nothing.

    Returns:
      The tokens it generated, by request id (one each).
    """
    if launched is None:
      return {}
    start = time.perf_counter()
    plan, sampled, t, t_real = launched.plan, launched.sampled, launched.t, launched.t_real
    new_R = np.asarray(launched.new_R)  # the one read-back of a step without logprobs
    if any(r.sampling.logprobs is not None for r in sampled):  # else they stay on the device
      chosen_R, top_RxM, ids_RxM = jax.device_get(launched.logprobs)
    now = time.perf_counter()
    self.host_time["wait"] += now - start
    self.steps += 1
    self.counts["step_tokens"] += t_real
    self.counts["padded_tokens"] += t - t_real
    out: dict[int, list[int]] = {}
    for j, r in enumerate(sampled):
      k = launched.index[j]
      if r.state == FINISHED:  # cancelled, or (async) stopped by its token of the step before
        continue
      if launched.drafted is None:
        emitted = [int(new_R[j])]
      else:  # a verify step: its tokens, then their count
        emitted = new_R[j, : max(new_R[j, -1], 1)].tolist()
        drafted, kept = launched.drafted[j], len(emitted) - 1
        r.computed -= drafted - kept  # the rejected drafts' K/V are not the sequence's
        self._free_past_computed(r)  # pages that only rejected drafts reached
        self.counts["spec_drafts"] += drafted
        self.counts["spec_accepted"] += kept
      if emitted[0] < 0:  # serve_step's mark of non-finite logits
        r.error = f"non-finite logits at output token {k}; the request was stopped"
        self.scheduler.remove(r)
        self._finish(r, "error")
        continue
      if r.sampling.logprobs is not None:  # never a verify step's row: one token
        r.logprobs.append(
            as_token_logprobs(chosen_R[j], top_RxM[j], ids_RxM[j], r.sampling.logprobs)
        )
      out[r.id] = []
      for i, token in enumerate(emitted):
        if not self._emit(r, k + i, token, now, out[r.id]):
          break
      if r.state == RUNNING and self.prefill_only:
        self.scheduler.park(r)
        r.state = PREFILLED
    if self.prefix_cache is not None:
      for r, _ in plan:
        if r.state in (RUNNING, PREFILLED):
          self._register(r)
    if launched.hidden is not None:  # what the target kept, for the MTP module (`MtpDrafter`)
      kept = [
          Span(r, at, first, r.computed - first)
          for (r, _), (at, first) in zip(plan, launched.spans)
          if r.state == RUNNING
      ]
      self._drafter.observe(kept, launched.hidden)
    self.host_time["apply"] += time.perf_counter() - now
    return out

  def _emit(self, r: Request, k: int, token: int, now: float, out: list[int]) -> bool:
    """Applies output token k of r (sampled, or a kept draft); False once r has finished."""
    if k < len(r.output):
      r.output[k] = token  # the PENDING the step's dispatch left
    else:
      r.output.append(token)  # a verify step's second token on
    r.token_times.append(now)
    if r.first_token_time is None:
      r.first_token_time = now
    out.append(token)
    stopped = token in r.stop_ids and k + 1 > r.sampling.min_tokens
    if r.grammar is not None and not stopped:
      if not r.grammar.accept(token):  # the mask allowed it: cannot happen
        r.error = f"output token {k} ({token}) broke the grammar: {r.grammar.error}"
        self.scheduler.remove(r)
        self._finish(r, "error")
        return False
      stopped = r.grammar.done  # the grammar is complete: nothing may follow
    if stopped or k + 1 >= r.max_tokens:
      self.scheduler.remove(r)  # its pages are freed now
      self._finish(r, "eos" if stopped else "length")
      return False
    return True

  def _register(self, r: Request) -> None:
    """Offers r's newly completed full pages to the prefix cache."""
    full = r.computed // self.page_size
    s = self.page_size
    while len(r.page_keys) < full:
      i = len(r.page_keys)
      r.page_keys.append(page_key(r.page_keys[-1] if i else b"", r.tokens[i * s : (i + 1) * s]))
    for i in range(r.registered, full):
      self.prefix_cache.insert(r.page_keys[i], r.pages[i])
    r.registered = max(r.registered, full)

  # -- whole batches ----------------------------------------------------------------------------

  def generate(
      self,
      prompts: list[list[int]],
      max_tokens: int = 16,
      temperature: float = 0.0,
      seed: int = 0,
      top_k: int = 0,
      top_p: float = 1.0,
  ) -> list[list[int]]:
    """Runs every prompt to its end and returns the generated tokens.

    Args:
      prompts: token ids of each prompt.
      max_tokens: the most tokens to generate per prompt.
      temperature: 0 is greedy; top_k and top_p narrow the sampled set (0 and 1: no limit).
      seed: request i samples with seed + i.

    Returns:
      The generated tokens of each prompt, in order (EOS kept when it ends one).

    Raises:
      ValueError: naming every bad prompt, before any work.
    """
    samplings = [SamplingParams(temperature, top_k, top_p, seed + i) for i in range(len(prompts))]
    errors = [
        (i, self.check_request(p, max_tokens, sp))
        for i, (p, sp) in enumerate(zip(prompts, samplings))
    ]
    errors = [f"prompt {i}: {e}" for i, e in errors if e]
    if errors:
      raise ValueError("; ".join(errors))
    ids = [self.add_request(p, max_tokens, sp) for p, sp in zip(prompts, samplings)]
    done = {}
    while len(done) < len(ids):
      self.step()
      done.update({r.id: r for r in self.finished()})
      if len(done) < len(ids) and not self.has_work():
        raise RuntimeError("requests were lost: none waiting or running, some not finished")
    failed = [f"prompt {i}: {done[rid].error}" for i, rid in enumerate(ids) if done[rid].error]
    if failed:
      raise RuntimeError("; ".join(failed))
    return [done[rid].output for rid in ids]

  # -- scoring a prompt -------------------------------------------------------------------------

  def score(self, prompt: Sequence[int], top_logprobs: int = 0) -> list[TokenLogprobs | None]:
    """Each prompt token's log-probability given the tokens before it (`serve.scoring`).

    Call it between steps, from the stepping thread.

    Args:
      prompt: token ids.
      top_logprobs: how many of the most likely tokens to list at each place.

    Returns:
      None for the first token, then each token's `TokenLogprobs`.
    """
    return self.scorer.score(self.params, prompt, top_logprobs)

  # -- metrics ----------------------------------------------------------------------------------

  def kv_usage(self) -> dict[str, float]:
    """Pages in use and how full they are:
    tokens stored / slots of the pages running requests hold."""
    owned = {p for r in self.running for p in r.pages}
    held = owned | {p for r in self.prefilled + self.incoming for p in r.pages}
    tokens = sum(r.computed for r in self.running)
    slots = sum(len(r.pages) for r in self.running) * self.page_size
    usage = {
        "pages_total": self.num_pages - 1,
        "pages_in_use": self.allocator.num_used,
        "pages_running": len(owned),
        # pages some request holds; the prefix cache's alone are free to evict (vLLM's "used")
        "pages_held": len(held),
        "cached_pages": len(self.prefix_cache or ()),
        "tokens": tokens,
        "slots": slots,
        "tokens_per_slot": tokens / slots if slots else 1.0,
    }
    if self.ring_size:  # the sliding-window layers' rings
      usage["ring_pages_total"] = self.ring_allocator.num_pages - 1
      usage["ring_pages_in_use"] = self.ring_allocator.num_used
    return usage

  def rings_note(self) -> str:
    """What the sliding-window layers' rings save, for a startup line ('' without rings)."""
    if not self.ring_size:
      return ""
    size = functools.partial(model_lib.kv_bytes, self.cfg, self.num_pages, self.page_size)
    rings = size(self.kv_dtype, window_pages=self.kv.window_pages)
    return (
        f"sliding layers keep rings of {self.ring_size} pages a sequence: KV pools "
        f"{rings / 2**20:.1f} MiB, {size(self.kv_dtype) / 2**20:.1f} MiB if they kept the context"
    )
