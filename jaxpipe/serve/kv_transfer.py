"""Moving a request, its cached K/V included, between engines (prefill/decode disaggregation).

Host to host: `export_request` on one engine gives a `KVState` (tokens and K/V as numpy
arrays), `import_request` on another adds it. Device to device, layer by layer: `kv_of` on the
source gives K/V still on its devices; the destination takes pages and a batch slot
(`reserve_request`), receives the arrays (`write_kv`, after `jax.device_put` to its `sharding`)
and admits the request once every (layer, page) is written (`admit_request`).

K/V move in chunks of a power of two pages (the binary digits of the page count), so that a
few compiled gathers and scatters serve every length. A model with sliding-window layers keeps
rings of its window's pages, not the context's: its requests move with computed=0 only (they
are recomputed where they land).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpipe.serve.pages import SCRATCH_PAGE
from jaxpipe.serve.request import INCOMING, PREFILLED, RUNNING, KVState, Request


def pow2_chunks(n: int) -> list[int]:
  """The powers of two that sum to n, largest first (13 -> [8, 4, 1]).

  Args:
    n: a page count, >= 0.

  Returns:
    The chunk sizes; [] for 0.
  """
  return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


class KVTransfer:
  """One engine's K/V export and import (`Engine.transfer`; it reads the engine's requests,
  scheduler, allocator and pools, and writes its pools)."""

  def __init__(self, engine):
    self.engine = engine
    self._unwritten: dict[int, set[tuple[int, int]]] = {}  # incoming -> (layer, page) unwritten

  @property
  def sharding(self) -> NamedSharding:
    """Where K/V for this engine must be to be written (`write_kv`): KV heads over its devices."""
    return self.engine.pool_sharding

  @functools.cached_property
  def gather_fn(self):
    """The compiled gather of pages of listed layers (one program per chunk size)."""

    def gather(kv, pages_N, layers_L):  # [G, L, N, page, K] (8-bit: and scales [G, L, N, page])
      idx = jnp.asarray(kv.layout.offsets)[layers_L][:, None] + pages_N[None, :]
      if kv.k_scales is None:
        return kv.k[:, idx], kv.v[:, idx]
      return (kv.k[:, idx], kv.k_scales[:, idx]), (kv.v[:, idx], kv.v_scales[:, idx])

    return jax.jit(gather, out_shardings=self.sharding)

  @functools.cached_property
  def scatter_fn(self):
    """The compiled write of `gather_fn`'s arrays into pages of listed layers (pools donated)."""

    def scatter(kv, pages_N, layers_L, k, v):  # k, v as `gather` returns them
      idx = jnp.asarray(kv.layout.offsets)[layers_L][:, None] + pages_N[None, :]
      put = lambda pool, x: pool.at[:, idx].set(x.astype(pool.dtype))
      if kv.k_scales is None:
        return kv.with_pools(put(kv.k, k), put(kv.v, v))
      (k, k_scales), (v, v_scales) = k, v
      return kv.with_pools(
          put(kv.k, k), put(kv.v, v), put(kv.k_scales, k_scales), put(kv.v_scales, v_scales)
      )

    return jax.jit(scatter, donate_argnums=0, out_shardings=self.engine.kv_cache_sharding)

  def precompile(self, move_pages: int, per_layer: bool = False) -> None:
    """Compiles the gather and write of every chunk of up to `move_pages` pages.

    Of all layers, or one with per_layer, by running them on the scratch page.

    Args:
      move_pages: the most pages one move takes; 0 compiles nothing.
      per_layer: the moves of one layer instead of all.

    Raises:
      ValueError: `move_pages` with a model whose sliding-window layers keep rings
        (`check_movable`).
    """
    if move_pages:
      self.check_movable()
    e = self.engine
    for size in pow2_chunks((1 << move_pages.bit_length()) - 1):
      scratch = np.full(size, SCRATCH_PAGE, np.int32)
      layers = self.layers(0 if per_layer else None)
      k, v = self.gather_fn(e.kv, scratch, layers)
      e.kv = self.scatter_fn(e.kv, scratch, layers, k, v)

  def layers(self, layer: int | None) -> np.ndarray:
    """The layers a move covers: all (None) or the one given.

    Args:
      layer: a layer index, or None for all.

    Returns:
      The layer indices, int32 [n_layers] or [1].

    Raises:
      ValueError: a layer outside [0, n_layers).
    """
    n = self.engine.cfg.n_layers
    if layer is None:
      return np.arange(n, dtype=np.int32)
    if not 0 <= layer < n:
      raise ValueError(f"layer={layer} is outside [0, {n})")
    return np.asarray([layer], np.int32)

  def check_movable(self) -> None:
    """K/V moves need every layer's pages of the context, which ring layers do not keep."""
    if self.engine.ring_size:
      raise ValueError(
          "this model's sliding-window layers keep rings of their window's pages, not the "
          "context's: moving a request's K/V between engines is not implemented for them; "
          "move it with computed=0 (recomputed) or serve it on one engine"
      )

  def forget(self, rid: int) -> None:
    """Drops what is known of an incoming request's unwritten K/V (it was cancelled).

    Args:
      rid: the request's id; one not known is ignored.
    """
    self._unwritten.pop(rid, None)

  # -- the source side --------------------------------------------------------------------------

  def kv_of(self, rid: int, layer: int | None = None) -> list[tuple[int, jax.Array, jax.Array]]:
    """K and V of a request's cached tokens, exactly its pages, on this engine's devices.

    Args:
      rid: a running or prefilled request.
      layer: one layer, or None for all.

    Returns:
      Chunks of a power of two pages (at most log2(pages) + 1 copies): (first page index, k, v),
      each [G, n_layers (1 with `layer`), chunk pages, page, head_dim], or with an 8-bit cache
      a pair (values, float32 scales [G, n_layers, chunk pages, page]).
    """
    self.check_movable()
    e = self.engine
    e.drain()
    r = e.requests[rid]
    if r.state not in (RUNNING, PREFILLED):
      raise ValueError(
          f"request {rid} is {r.state}; only a running or prefilled request has pages to export"
      )
    used = math.ceil(r.computed / e.page_size)
    e.flush_fills()
    out, at = [], 0
    for size in pow2_chunks(used):
      pages = np.asarray(r.pages[at : at + size], np.int32)
      k, v = self.gather_fn(e.kv, pages, self.layers(layer))
      out.append((at, k, v))
      at += size
    return out

  def export_request(self, rid: int, with_kv: bool = True) -> KVState:
    """A request's tokens and cached K/V, for `import_request` or `reserve_request` elsewhere.

    Args:
      rid: a running or prefilled request.
      with_kv: False: no K/V (`kv_of` moves them device to device).

    Returns:
      The request as a `KVState`, K/V as host arrays.
    """
    e = self.engine
    e.drain()
    r = e.requests[rid]
    if r.state not in (RUNNING, PREFILLED):
      raise ValueError(f"request {rid} is {r.state}; only a running or prefilled request can move")
    k = v = None
    if with_kv:
      self.check_movable()
      chunks = jax.device_get([(k, v) for _, k, v in self.kv_of(rid)])
      if chunks:
        k, v = jax.tree.map(lambda *c: np.concatenate(c, axis=2), *chunks)
      else:
        k, v = self._empty_kv(r.computed), self._empty_kv(r.computed, v=True)
    return KVState(
        list(r.prompt),
        list(r.output),
        r.max_tokens,
        r.sampling,
        r.eos_id,
        r.computed,
        k,
        v,
        r.arrival,
        r.first_token_time,
        list(r.token_times),
        list(r.logprobs),
    )

  # -- the destination side ---------------------------------------------------------------------

  def kv_shape(self, computed: int, layers: int | None = None, v: bool = False) -> tuple[int, ...]:
    """Shape of K (or V) for `computed` cached tokens: [G, layers, pages, page_size, width].

    Args:
      computed: cached tokens; pages = ceil(computed / page_size).
      layers: layers moved; None: all.
      v: V's shape (width 0 for latents, which the K pool holds whole), else K's.

    Returns:
      The shape, G the cached heads (`model.cached_heads`).
    """
    cfg = self.engine.cfg
    heads, k_width, v_width = self.engine.cached
    return (
        heads,
        cfg.n_layers if layers is None else layers,
        math.ceil(computed / self.engine.page_size),
        self.engine.page_size,
        v_width if v else k_width,
    )

  def _empty_kv(self, computed: int, v: bool = False):
    """K (or V) of a request with no cached pages, as `export_request` gives it."""
    shape = self.kv_shape(computed, v=v)
    values = np.zeros(shape, self.engine.kv_dtype)
    if self.engine.kv.k_scales is None:
      return values
    return values, np.zeros(shape[:-1], np.float32)

  def _shape_error(self, name: str, x, want: tuple[int, ...]) -> str | None:
    """Why x does not hold K (or V) of shape `want` for this engine's cache, or None."""
    if self.engine.kv.k_scales is None:
      if isinstance(x, tuple) or tuple(x.shape) != want:
        got = tuple(x.shape) if not isinstance(x, tuple) else "a (values, scales) pair"
        return f"{name} has shape {got}; this engine's float cache takes {want}"
      return None
    if not isinstance(x, tuple) or len(x) != 2:
      return (
          f"{name} must be a (values, scales) pair for this engine's "
          f"{self.engine.kv_cache_dtype} cache"
      )
    if tuple(x[0].shape) != want or tuple(x[1].shape) != want[:-1]:
      return (
          f"{name} has shapes {tuple(x[0].shape)}, {tuple(x[1].shape)}; this engine takes "
          f"{want} and {want[:-1]}"
      )
    return None

  def reserve_request(self, state: KVState) -> int:
    """Takes pages and a batch slot for a request whose K/V will follow.

    The request is not scheduled until its K/V are written (`write_kv`) and it is admitted
    (`admit_request`).

    Args:
      state: the request, as `export_request` gives it (K/V may be None).

    Returns:
      The request's id on this engine.

    Raises:
      ValueError: one line, if the request is bad or cannot be taken now.
    """
    e = self.engine
    if state.computed:
      self.check_movable()
    error = e.check_request(state.prompt, state.max_tokens, state.sampling, state.eos_id)
    want = self.kv_shape(state.computed)
    if error is None and state.k is not None:
      error = self._shape_error("the K", state.k, want)
      error = error or self._shape_error("the V", state.v, self.kv_shape(state.computed, v=True))
      if error:
        error += f" for {state.computed} tokens ([kv_heads, layers, pages, page_size, head_dim])"
    if error is None and not e.scheduler.has_slot():
      error = f"the batch is full ({e.max_batch} running or incoming requests)"
    if error is None and not e.allocator.can_alloc(want[2]):
      error = (
          f"{want[2]} free pages are needed to import the request, "
          f"{e.allocator.num_free} are free"
      )
    if error is not None:
      raise ValueError(f"cannot import the request: {error}")
    r = Request(
        e.new_id(),
        list(state.prompt),
        state.max_tokens,
        state.sampling,
        state.eos_id,
        output=list(state.output),
        logprobs=list(state.logprobs),
        computed=state.computed,
        state=INCOMING,
        arrival=state.arrival,
        first_token_time=state.first_token_time,
        token_times=list(state.token_times),
    )
    if state.sampling.guide is not None:  # the grammar, past the tokens generated so far
      r.grammar = state.sampling.guide.matcher(state.output)
    r.pages = [e.allocator.alloc() for _ in range(want[2])]
    self._unwritten[r.id] = {(l, i) for l in range(e.cfg.n_layers) for i in range(want[2])}
    e.requests[r.id] = r
    e.scheduler.expect(r)
    return r.id

  def write_kv(self, rid: int, k, v, layer: int | None = None, first: int = 0) -> None:
    """Writes K/V of an incoming request into its reserved pages.

    Args:
      rid: a reserved request (`reserve_request`).
      k: [G, layers (1 with `layer`), pages, page_size, head_dim] (8-bit cache: a (values,
        scales) pair); arrays on other devices are copied here first (device to device).
      v: like k.
      layer: the one layer k and v hold, or None for all.
      first: the index in the request's block table of the first page they fill.
    """
    e = self.engine
    r = e.requests[rid]
    if r.state != INCOMING:
      raise ValueError(f"request {rid} is {r.state}; K/V are written only into a reserved request")
    values = k[0] if isinstance(k, tuple) and k else k
    size = values.shape[2] if getattr(values, "ndim", 0) == 5 else -1
    want = self.kv_shape(r.computed, None if layer is None else 1)[:2] + (size, e.page_size)
    for name, x, width in (("k", k, e.cached[1]), ("v", v, e.cached[2])):
      error = self._shape_error(name, x, want + (width,))
      if error or not 0 <= first <= len(r.pages) - size:
        error = error or f"{name} has shape {tuple(jax.tree.leaves(x)[0].shape)}"
        raise ValueError(
            f"{error} at page {first}; request {rid} holds "
            f"{self.kv_shape(r.computed)} ([kv_heads, layers, pages, page, head_dim])"
        )
    layers = self.layers(layer)
    k, v = jax.device_put((k, v), self.sharding)
    e.flush_fills()
    pages = np.asarray(r.pages[first : first + size], np.int32)
    e.kv = self.scatter_fn(e.kv, pages, layers, k, v)
    self._unwritten[rid].difference_update(
        (l, i) for l in layers.tolist() for i in range(first, first + size)
    )

  def admit_request(self, rid: int) -> None:
    """An incoming request whose K/V are all written joins the batch.

    Args:
      rid: the request's id.

    Raises:
      ValueError: the request is not incoming, or some (layer, page) of its K/V is not written
        yet.
    """
    r = self.engine.requests[rid]
    if r.state != INCOMING:
      raise ValueError(f"request {rid} is {r.state}; only an incoming request can be admitted")
    missing = self._unwritten[rid]
    if missing:
      raise ValueError(
          f"request {rid} still lacks the K/V of {len(missing)} (layer, page) pairs, "
          f"layers {sorted({l for l, _ in missing})}; write them (write_kv) first"
      )
    del self._unwritten[rid]
    self.engine.scheduler.join(r)
    r.state = RUNNING

  def import_request(self, state: KVState) -> int:
    """Adds a request with its K/V already cached.

    Args:
      state: from `export_request`; computed=0 and no K/V: the request is recomputed here from
        its tokens.

    Returns:
      The request's id on this engine.
    """
    e = self.engine
    rid = self.reserve_request(state)
    if e.requests[rid].pages:
      if state.k is None:
        e.cancel(rid)
        e.finished()
        raise ValueError(f"cannot import the request: {state.computed} cached tokens but no K/V")
      at = 0
      for size in pow2_chunks(len(e.requests[rid].pages)):
        k, v = jax.tree.map(lambda x, at=at, size=size: x[:, :, at : at + size], (state.k, state.v))
        self.write_kv(rid, k, v, first=at)
        at += size
    self.admit_request(rid)
    return rid
