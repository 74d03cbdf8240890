"""A step's token batch: the host arrays one engine step runs on, built from the scheduler's plan.

The plan is a list of (request, tokens this step). Tokens are laid out flat, each request's
contiguous, and padded to a bucket of tokens; block tables are padded to a bucket of pages per
sequence, so that the number of compiled step programs stays bounded. A request whose tokens
are all cached after the step gets a sampled row, with its sampling values. Host-side numpy
only: the engine dispatches what this builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxpipe.serve import grammar as grammar_lib
from jaxpipe.serve import model as model_lib
from jaxpipe.serve.pages import SCRATCH_PAGE
from jaxpipe.serve.request import PENDING, Request, token_slice
from jaxpipe.serve.sampling import MAX_BANNED, LogitBias, Penalties, SamplingBatch


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """What an engine's steps are padded to and which arrays its attention reads."""

  page_size: int  # tokens per page
  max_batch: int  # rows of the per-sequence and sampling arrays (R = B) at most (`row_count`)
  token_buckets: tuple[int, ...]  # padded tokens per step, ascending
  page_buckets: tuple[int, ...]  # padded pages per sequence, ascending
  ring_size: int = 0  # pages of a sliding layer's ring; 0: no ring layers
  per_token: bool = True  # the backend reads per-token block tables (tables_TxN)
  spec_tokens: int = 0  # drafts per row of a verify step (`serve.speculative`); 0: none


@dataclasses.dataclass
class StepBatch:
  """One step's arrays and what the engine needs to apply its result."""

  tokens: model_lib.TokenBatch
  sampling: SamplingBatch
  sampled: list[Request]  # in row order
  t: int  # padded tokens
  t_real: int  # scheduled tokens
  pages: int  # padded pages per sequence
  index: list[int]  # per sampled row: the output index its token fills


def powers_of_two(limit: int, start: int = 1) -> tuple[int, ...]:
  """Buckets: powers of two from `start` below `limit`, then `limit`.

  Args:
    limit: the largest bucket.
    start: the smallest bucket (then doubled).

  Returns:
    The ascending buckets, `limit` last.
  """
  out, b = [], start
  while b < limit:
    out.append(b)
    b *= 2
  return tuple(out) + (limit,)


def token_buckets(limit: int, start: int = 8, halves_from: int = 64) -> tuple[int, ...]:
  """Default step sizes: powers of two from `start`, and from `halves_from` on also 1.5 times
  each (96, 192, 384, 768, ...), below `limit`, then `limit`.

  From a few dozen rows on a step's GEMMs take time in proportion to its padded rows; the
  half-steps cap the padding at a third of a step (a 280-token step runs 384 rows, not 512)
  for a few more programs (12 against 8 up to 1,024 tokens).

  Args:
    limit: the largest bucket (the step's token budget).
    start: the smallest bucket (at most `limit`).
    halves_from: the first power of two followed by a half-step.

  Returns:
    The ascending buckets, `limit` last.
  """
  out = set()
  for b in powers_of_two(limit, min(start, limit))[:-1]:
    out.add(b)
    if b >= halves_from and b * 3 // 2 < limit:
      out.add(b * 3 // 2)
  return tuple(sorted(out)) + (limit,)


def check_buckets(
    name: str, buckets: Sequence[int] | None, limit: int, default: tuple[int, ...]
) -> tuple[int, ...]:
  """A setting's buckets, sorted, the limit added (None: `default`).

  Args:
    name: the setting's name, for the message.
    buckets: the buckets asked for, or None.
    limit: the largest bucket, always included.
    default: the buckets without a setting.

  Returns:
    The ascending buckets, without repeats, `limit` last.

  Raises:
    ValueError: (one line) a bucket outside [1, limit].
  """
  if buckets is None:
    return default
  out = tuple(sorted({int(b) for b in buckets if 0 < b < limit} | {limit}))
  if any(not 0 < b <= limit for b in buckets):
    raise ValueError(f"{name}={tuple(buckets)} must lie in [1, {limit}]")
  return out


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds n (the buckets ascend; the last is the limit).

  Args:
    n: the size to hold, at most the limit.
    buckets: the ascending buckets.

  Returns:
    The bucket.
  """
  return next(b for b in buckets if b >= n)


def row_count(t: int, max_batch: int) -> int:
  """The sequence and sampled rows of a step of t padded tokens: each sequence brings at least one
  token, so a step of few tokens (a small decode batch) pads its rows, its logits and its
  sampling to t rather than to `max_batch`.

  Args:
    t: the step's padded tokens.
    max_batch: the engine's running sequences at most.

  Returns:
    min(t, max_batch).
  """
  return min(t, max_batch)


def build(
    plan: Sequence[tuple[Request, int]], shape: BatchShape, after_rows: Mapping[int, int]
) -> StepBatch:
  """The arrays of a step that runs `plan`.

  Args:
    plan: (request, its tokens this step) in the scheduler's order; each request's pages (and
      ring) already hold room for them.
    shape: the engine's padding and layout.
    after_rows: request id -> its row among the sampled tokens of the step in flight (async
      scheduling); a request whose next input is that PENDING token reads it from there.

  Returns:
    The step's `TokenBatch` and `SamplingBatch`, the sampled requests and the sizes.
  """
  s = shape.page_size
  k = shape.spec_tokens if any(r.drafts for r, _ in plan) else 0  # a verify step's drafts
  t_real = sum(n for _, n in plan)
  t = bucket(t_real, shape.token_buckets)
  r_max = row_count(t, shape.max_batch)
  assert len(plan) <= r_max and all(n > 0 for _, n in plan), plan  # a row per sequence
  n_pages = bucket(max(len(r.pages) for r, _ in plan), shape.page_buckets)
  tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
  slots, tables = np.full(t, SCRATCH_PAGE * s, np.int32), np.zeros((t, n_pages), np.int32)
  rows = np.zeros(r_max * (k + 1), np.int32)
  drafts = np.full((r_max, k), -1, np.int32)
  seq_tables = np.zeros((r_max, n_pages), np.int32)
  seq_starts, seq_counts, seq_cached = (np.zeros(r_max, np.int32) for _ in range(3))
  temp, top_p = np.zeros(r_max, np.float32), np.ones(r_max, np.float32)
  top_k, seed, out_index = (np.zeros(r_max, np.int32) for _ in range(3))
  banned = np.full((r_max, MAX_BANNED), -1, np.int32)
  prev_T = np.full(t, -1, np.int32)
  ring_slots = ring_tables = ring_seq_tables = None
  if shape.ring_size:  # entry i of a ring's table: ring[i mod R]
    ring_slots = np.full(t, SCRATCH_PAGE * s, np.int32)
    ring_tables = np.zeros((t, n_pages), np.int32)
    ring_seq_tables = np.zeros((r_max, n_pages), np.int32)
    around = np.arange(n_pages) % shape.ring_size
  sampled, at = [], 0
  for i, (r, n) in enumerate(plan):
    table = np.asarray(r.pages, np.int32)
    seq_tables[i, : len(table)] = table
    seq_starts[i], seq_counts[i], seq_cached[i] = at, n, r.computed
    pos = np.arange(r.computed, r.computed + n)
    known = min(r.computed + n, r.length)  # then the drafts, which follow the known tokens
    tokens[at : at + n] = token_slice(r, r.computed, known) + r.drafts[: r.computed + n - known]
    if r.computed + n == r.length and r.output and r.output[-1] == PENDING:
      # only the step in flight can have left a token unknown: it is read on the devices
      prev_T[at + n - 1] = after_rows[r.id]
    positions[at : at + n] = pos
    slots[at : at + n] = table[pos // s] * s + pos % s
    if shape.per_token:
      tables[at : at + n, : len(table)] = table
    if shape.ring_size:
      ring = np.asarray(r.ring, np.int32)
      ring_seq_tables[i] = ring[around]
      ring_slots[at : at + n] = ring[(pos // s) % shape.ring_size] * s + pos % s
      if shape.per_token:
        ring_tables[at : at + n] = ring[around]
    at += n
    if r.computed + n == r.length + len(r.drafts):  # all its tokens cached after it: sample
      j, m = len(sampled), len(r.drafts)
      if k:  # row j's logits after its last token and each draft: k + 1 rows (padding repeats)
        rows[j * (k + 1) : (j + 1) * (k + 1)] = at - 1 - m + np.minimum(np.arange(k + 1), m)
        drafts[j, :m] = r.drafts
      else:
        rows[j] = at - 1
      sp = r.sampling
      temp[j], top_k[j], top_p[j], seed[j] = sp.temperature, sp.top_k, sp.top_p, sp.seed
      out_index[j] = len(r.output)
      if len(r.output) < sp.min_tokens:
        ids = sorted(set(r.stop_ids))
        banned[j, : len(ids)] = ids
      sampled.append(r)
  batch = model_lib.TokenBatch(
      tokens,
      positions,
      slots,
      tables,
      rows,
      seq_tables,
      seq_starts,
      seq_counts,
      seq_cached,
      prev_T,
      ring_slots,
      ring_tables,
      ring_seq_tables,
  )
  sampling = SamplingBatch(
      temp,
      top_k,
      top_p,
      seed,
      out_index,
      banned,
      _min_p(sampled, r_max),
      _logit_bias(sampled, r_max),
      _penalties(sampled, r_max, after_rows),
      _allowed(sampled, r_max),
      drafts if k else None,
  )
  index = out_index[: len(sampled)].tolist()
  return StepBatch(batch, sampling, sampled, t, t_real, n_pages, index)


def _allowed(sampled: list[Request], r_max: int) -> np.ndarray | None:
  """The sampled rows' token bitmask, all ones, or None when no row is constrained: the
  engine fills the constrained rows from their grammars (`grammar.fill_masks`) while the
  step's model runs, once their last tokens are on the host (`Engine.launch`)."""
  guides = [r.grammar for r in sampled if r.grammar is not None]
  if not guides:
    return None
  return np.full((r_max, grammar_lib.words(guides[0].vocab)), -1, np.int32)


def _pow2(n: int) -> int:
  """The smallest power of two >= max(n, 1): padded widths, so steps share compiled programs."""
  return 1 << max(n - 1, 0).bit_length()


def _min_p(sampled: list[Request], r_max: int) -> np.ndarray | None:
  """Each sampled row's min_p, or None when no row uses it."""
  if not any(r.sampling.min_p for r in sampled):
    return None
  out = np.zeros(r_max, np.float32)
  out[: len(sampled)] = [r.sampling.min_p for r in sampled]
  return out


def _logit_bias(sampled: list[Request], r_max: int) -> LogitBias | None:
  """Each sampled row's biased ids and biases, or None when no row biases a token."""
  width = max((len(r.sampling.logit_bias) for r in sampled), default=0)
  if not width:
    return None
  ids = np.full((r_max, _pow2(width)), -1, np.int32)
  values = np.zeros(ids.shape, np.float32)
  for j, r in enumerate(sampled):
    for b, (token, bias) in enumerate(r.sampling.logit_bias):
      ids[j, b], values[j, b] = token, bias
  return LogitBias(ids, values)


def _penalties(
    sampled: list[Request], r_max: int, after_rows: Mapping[int, int] | None
) -> Penalties | None:
  """Each sampled row's penalties and the tokens they count, or None when no row is penalized.

  A penalized row's last output token may still be in the step in flight (PENDING): `pending_R`
  names its row there, and the device reads it from that step's sampled tokens.
  """
  rows = [(j, r) for j, r in enumerate(sampled) if r.sampling.penalized]
  if not rows:
    return None
  presence, frequency = np.zeros(r_max, np.float32), np.zeros(r_max, np.float32)
  repetition, pending = np.ones(r_max, np.float32), np.full(r_max, -1, np.int32)
  known = {j: [t for t in r.output if t != PENDING] for j, r in rows}
  output = np.full((r_max, _pow2(max(len(k) for k in known.values()))), -1, np.int32)
  prompts = [r for _, r in rows if r.sampling.repetition_penalty != 1]
  prompt = np.full((r_max, _pow2(max((len(r.prompt) for r in prompts), default=0))), -1, np.int32)
  for j, r in rows:
    sp = r.sampling
    presence[j], frequency[j], repetition[j] = (
        sp.presence_penalty,
        sp.frequency_penalty,
        sp.repetition_penalty,
    )
    output[j, : len(known[j])] = known[j]
    if sp.repetition_penalty != 1:
      prompt[j, : len(r.prompt)] = r.prompt
    if r.output and r.output[-1] == PENDING:
      pending[j] = after_rows[r.id]
  return Penalties(presence, frequency, repetition, output, prompt, pending)
