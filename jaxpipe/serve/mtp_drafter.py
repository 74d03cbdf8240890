"""Drafts from the served model's own multi-token prediction module (DeepSeek-V3's MTP), as
vLLM's MTP proposer runs it (`speculative.SpecConfig(method="mtp")`).

The module (`models.mtp`, module 1) is one decoder layer whose entry at position i reads the
target's last hidden state h_i (after its final norm) and the token x_{i+1}; its output there
predicts x_{i+2}. The drafter keeps that layer's K/V in a paged pool of its own, one layer deep,
with a block table per request.

After each target step (`observe`), the step's positions whose K/V the target kept (a verify
step's accepted drafts, a prefill chunk) get their module entries: their next tokens are all
known then, and the target step returned its hidden states. For a request that just sampled,
the module's output at its last position gives the first draft. The next k - 1 drafts continue
from the module's own output, the layer reused at the positions after (EAGLE's way, which vLLM
follows past the checkpoint's depth): the states it chains are the layer's output before its
norm, and its entries there are overwritten once the target's tokens are known. All of it is
one program per step, dispatched right after the target's step is read; `propose` reads its
drafts when the next step is built.

The drafts are greedy, so `speculative.verify` keeps the target's distribution exactly. The module
has no states for positions the target took from the prefix cache: such a request does not
speculate (`lost`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.models import mtp as mtp_lib
from jaxpipe.models import rope as rope_lib
from jaxpipe.models.layers import rms_norm
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.serve import model as model_lib
from jaxpipe.serve.pages import PageAllocator
from jaxpipe.serve.request import RUNNING, Request


@dataclasses.dataclass
class _Mirror:
  """The module's cache of one request."""

  table: list[int]  # its pages in the drafter's pool
  done: int = 0  # positions 0..done-1 hold entries of the target's tokens and states
  lost: bool = False  # a gap the module cannot fill (a prefix-cache hit, no pages): no drafts


@dataclasses.dataclass(frozen=True)
class Span:
  """What one request kept of a target step (`observe`)."""

  request: Request
  at: int  # its first token's index in the step's tokens
  first: int  # that token's position
  count: int  # tokens kept from there


def _draft(
    cfg,
    params,
    pools,
    hidden_SxD,
    gather_T,
    batch,
    row_pos_R,
    row_tables_RxN,
    *,
    k: int,
    s: int,
    layout: model_lib.PoolLayout,
    backend: str,
):
  """The module over a step's kept positions, then k - 1 more tokens per row: (drafts [R, k],
  pools). gather_T: each token's index in the target's states; batch.rows_R: each row's last
  real token; row_pos_R: that token's position; row_tables_RxN: the row's block table."""
  p, moe = mtp_lib.module(params, 1), cfg.moe is not None
  dtypes = [None if x is None else x.dtype for x in pools]
  hook = model_lib._PagedHook(tuple(model_lib._to_bits(x) for x in pools), layout, batch, backend)
  # what transformers' length-dependent rotary variants take (`model._seq_lens`)
  dynamic = rope_lib.scaling_of(cfg.rope_scaling).length_dependent
  scale = params["final_norm"]["scale"]
  h_TxD = rms_norm(hidden_SxD[gather_T], scale, cfg.norm_eps, cfg.norm_plus_one)
  x = mtp_lib.module_input(cfg, params, p, batch.tokens_T[None], h_TxD[None])
  positions, lens = batch.positions_T, model_lib._seq_lens(batch) if dynamic else None
  out_TxD = model_lib._layer(cfg, hook, p["block"], 0, x, positions, moe, lens)[0]
  out_RxD = out_TxD[batch.rows_R]
  draft = lambda out: jnp.argmax(mtp_lib.module_logits(cfg, params, p, out[None])[0], -1)
  drafts = [draft(out_RxD).astype(jnp.int32)]
  rows = jnp.arange(row_pos_R.shape[0])
  for j in range(1, k):  # the layer again, one token a row, from its own output
    pos_R = row_pos_R + j
    slots_R = row_tables_RxN[rows, pos_R // s] * s + pos_R % s
    one = jnp.ones_like(rows)  # each row a sequence of one token (padding rows: page 0's)
    hook.batch = model_lib.TokenBatch(
        drafts[-1], pos_R, slots_R, row_tables_RxN, rows, row_tables_RxN, rows, one, pos_R
    )
    x = mtp_lib.module_input(cfg, params, p, drafts[-1][None], out_RxD[None])
    lens = pos_R + 1 if dynamic else None
    out_RxD = model_lib._layer(cfg, hook, p["block"], 0, x, pos_R, moe, lens)[0]
    drafts.append(draft(out_RxD).astype(jnp.int32))
  pools = tuple(model_lib._from_bits(x, d) for x, d in zip(hook.pools, dtypes))
  return jnp.stack(drafts, axis=1), pools


class MtpDrafter:
  """Greedy drafts from the model's first MTP module (`Drafter`)."""

  def __init__(
      self,
      cfg: TransformerConfig,
      params: dict,
      k: int,
      *,
      num_pages: int,
      page_size: int,
      max_batch: int,
      max_seq_len: int,
      backend: str,
      sharding: jax.sharding.Sharding,
      mla_cache: str = "latent",
  ):
    """Args:
    cfg: the served model (`model.mtp_depth` >= 1).
    params: its parameters, on the engine's device.
    k: drafts per request at most.
    num_pages: the module's pool, the scratch page 0 included.
    page_size: tokens per page.
    max_batch: the engine's rows.
    max_seq_len: the engine's context.
    backend: the engine's paged attention backend (resolved: `Engine.backend`).
    sharding: the engine's pools' (`Engine.pool_sharding`).
    mla_cache: what a latent-attention model's pages hold (`model.cached_heads`).

    Raises:
      ValueError: a model without MTP modules.
    """
    if cfg.mtp_depth < 1:
      raise ValueError(
          "speculative method 'mtp' drafts with the model's multi-token prediction module, and "
          "this model has none (model.mtp_depth=0); use method 'ngram' or 'draft', or a "
          "checkpoint with MTP layers (DeepSeek-V3's hold one)"
      )
    self.cfg, self.params, self.k = cfg, params, k
    self.page_size, self.max_batch = page_size, max_batch
    self.width = math.ceil((max_seq_len + k) / page_size)  # a block table's entries
    heads, k_width, v_width = model_lib.cached_heads(cfg, mla_cache)
    dtype = model_lib.kv_dtype(cfg)
    dtype = model_lib.BITS if dtype == jnp.bfloat16 else dtype  # held as its bits
    # placed as the program returns them (over the engine's mesh): one program per shape
    zeros = lambda w: jax.device_put(jnp.zeros((heads, num_pages, page_size, w), dtype), sharding)
    self.kv = model_lib.KVPages(zeros(k_width), zeros(v_width), num_pages)
    self.allocator = PageAllocator(num_pages)
    self.mirrors: dict[int, _Mirror] = {}
    self._program = jax.jit(
        functools.partial(_draft, cfg, k=k, s=page_size, layout=self.kv.layout, backend=backend),
        donate_argnums=1,
    )
    self._drafts: jax.Array | None = None  # the last observe's [R, k], on the device
    self._rows: dict[int, tuple[int, int]] = {}  # request id -> (its row there, positions)
    self.counts = {"lost": 0}  # requests that stopped speculating

  def observe(self, spans: Sequence[Span], hidden_SxD: jax.Array) -> None:
    """Writes the module's entries for what the target kept of a step, and drafts for the
    requests that sampled in it.

    Args:
      spans: each running request's kept tokens of the step.
      hidden_SxD: the step's last hidden states, on the device (`serve_step(hidden=True)`).
    """
    s, t_max = self.page_size, hidden_SxD.shape[0]
    tokens, positions, slots, gather = (np.zeros(t_max, np.int32) for _ in range(4))
    tables = np.zeros((t_max, self.width), np.int32)
    rows, row_pos = np.zeros(self.max_batch, np.int32), np.zeros(self.max_batch, np.int32)
    row_tables = np.zeros((self.max_batch, self.width), np.int32)
    # the tokens by request, as the ragged backends read them (`TokenBatch.seq_*`)
    seq_tables = np.zeros((self.max_batch, self.width), np.int32)
    seq_starts, seq_counts, seq_cached = (np.zeros(self.max_batch, np.int32) for _ in range(3))
    b = 0
    self._rows, at = {}, 0
    for span in spans:
      r = span.request
      m = self.mirrors.setdefault(r.id, _Mirror([]))
      if not m.lost and span.first > m.done:  # positions it never saw (prefix-cache hits)
        self._lose(m)
      end = span.first + span.count  # == r.computed
      if m.lost or not self._grow(m, end + self.k - 1):
        continue
      table = np.asarray(m.table, np.int32)
      pos = np.arange(span.first, end)
      n = len(pos)
      tokens[at : at + n] = r.tokens[span.first + 1 : end + 1]  # x_{i+1}: all known now
      positions[at : at + n] = pos
      slots[at : at + n] = table[pos // s] * s + pos % s
      tables[at : at + n, : len(table)] = table
      gather[at : at + n] = np.arange(span.at, span.at + n)
      seq_tables[b, : len(table)] = table
      seq_starts[b], seq_counts[b], seq_cached[b] = at, n, span.first
      b += 1
      m.done = max(m.done, end)
      at += n
      if end == len(r.tokens) - 1 and len(self._rows) < self.max_batch:  # it sampled: drafts
        j = len(self._rows)
        rows[j], row_pos[j], row_tables[j, : len(table)] = at - 1, end - 1, table
        self._rows[r.id] = (j, end)
    if not at:
      self._drafts = None
      return
    batch = model_lib.TokenBatch(
        tokens, positions, slots, tables, rows, seq_tables, seq_starts, seq_counts, seq_cached
    )
    self._drafts, pools = self._program(
        self.params, self.kv.pools, hidden_SxD, gather, batch, row_pos, row_tables
    )
    self.kv = self.kv.with_pools(*pools)

  def _grow(self, m: _Mirror, positions: int) -> bool:
    """m's pages cover `positions`; False (m lost) when the pool has too few."""
    need = math.ceil(positions / self.page_size) - len(m.table)
    if need > 0 and not self.allocator.can_alloc(need):
      self._lose(m)
      return False
    m.table += [self.allocator.alloc() for _ in range(max(need, 0))]
    return True

  def _lose(self, m: _Mirror) -> None:
    """m drafts no more; its pages go back."""
    m.lost = True
    self.counts["lost"] += 1
    self.allocator.free(m.table)
    m.table = []

  def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
    """Each request's drafts from the last `observe`.

    Args:
      requests: the requests that may speculate.
      limits: the most drafts each may take.

    Returns:
      Their drafts; [] for a request the last step left without any.
    """
    if self._drafts is None:
      return [[] for _ in requests]
    drafts = np.asarray(self._drafts)
    out = []
    for r, k in zip(requests, limits):
      j, computed = self._rows.get(r.id, (None, None))
      ok = j is not None and computed == r.computed and r.state == RUNNING
      out.append(drafts[j, :k].tolist() if ok else [])
    return out

  def forget(self, rid: int) -> None:
    """Gives back the pages of a request that finished.

    Args:
      rid: the request's id on the target engine.
    """
    m = self.mirrors.pop(rid, None)
    if m is not None:
      self.allocator.free(m.table)
