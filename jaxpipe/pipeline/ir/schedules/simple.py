"""GPipe, 1F1B and interleaved 1F1B: the single-direction schedules with full backwards.

- `gpipe` follows torch.distributed.pipelining's `ScheduleGPipe`: every forward in
  micro-batch order, then every backward in micro-batch order.
- `one_f_one_b` follows Megatron-Core's `forward_backward_pipelining_without_interleaving`:
  min(p - rank - 1, m) warm-up forwards, then one forward and one backward at a time, then
  the remaining backwards. (torch's `Schedule1F1B` runs the same per-rank order but needs m >= p.)
- `interleaved_1f1b` follows Megatron-Core's `forward_backward_pipelining_with_interleaving`:
  v chunks per rank on `Placement.interleaved(p, v)`, forwards walk `get_schedule_table`
  (groups of g micro-batches, chunk by chunk), backwards walk it with the chunk order reversed,
  and rank r runs (p - r - 1)*2 + (v - 1)*g warm-up forwards, capped at m*v.
"""

from __future__ import annotations

from jaxpipe.pipeline.ir.schedule import Action, Op, Placement, Schedule


def _one_chunk(name: str, chunks: int | None, pp: int, microbatches: int) -> None:
  if chunks not in (None, 1):
    raise ValueError(
        f"{name} runs one chunk per rank, got chunks={chunks}; use "
        "'interleaved-1f1b' for several chunks per rank"
    )
  if pp < 1 or microbatches < 1:
    raise ValueError(f"{name}: pp={pp} and microbatches={microbatches} must be >= 1")


def _no_options(name: str, options: dict) -> None:
  if options:
    raise ValueError(f"{name} takes no options, got {sorted(options)}")


def gpipe(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """All forwards, then all backwards, each in micro-batch order.

  Args:
    pp: ranks.
    microbatches: micro-batches per step.
    chunks: 1 or None; one chunk per rank.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.interleaved(pp)`.

  Raises:
    ValueError: chunks other than 1, a count below 1, or an option.
  """
  _one_chunk("gpipe", chunks, pp, microbatches)
  _no_options("gpipe", options)
  m = microbatches
  ranks = [
      [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
      for r in range(pp)
  ]
  return Schedule("gpipe", Placement.interleaved(pp), m, ranks)


def one_f_one_b(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """Megatron's non-interleaved 1F1B: warm-up forwards, steady 1F1B, cool-down backwards.

  Rank r runs min(pp - r - 1, microbatches) warm-up forwards.

  Args:
    pp: ranks.
    microbatches: micro-batches per step.
    chunks: 1 or None; one chunk per rank.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.interleaved(pp)`.

  Raises:
    ValueError: chunks other than 1, a count below 1, or an option.
  """
  _one_chunk("1f1b", chunks, pp, microbatches)
  _no_options("1f1b", options)
  m = microbatches
  ranks = []
  for r in range(pp):
    warmup = min(pp - r - 1, m)
    ops: list[Op] = [Action("F", r, i) for i in range(warmup)]
    for k in range(m - warmup):
      ops += [Action("F", r, k + warmup), Action("B", r, k)]
    ops += [Action("B", r, k) for k in range(m - warmup, m)]
    ranks.append(ops)
  return Schedule("1f1b", Placement.interleaved(pp), m, ranks)


def schedule_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
  """Megatron's `get_schedule_table`: the (micro-batch, chunk) of each forward, in order.

  Args:
    microbatches: micro-batches per step.
    chunks: chunks per rank.
    group: micro-batches per group; each group runs through every chunk before the next (the
      last group takes what is left).

  Returns:
    microbatches * chunks (micro-batch, chunk) pairs.
  """
  table = []
  for lo in range(0, microbatches, group):
    hi = microbatches if lo + group >= microbatches else lo + group
    table += [(mb, c) for c in range(chunks) for mb in range(lo, hi)]
  return table


def interleaved_warmup(pp: int, rank: int, microbatches: int, chunks: int, group: int) -> int:
  """Megatron's warm-up count for the interleaved schedule (forwards before the first backward).

  Args:
    pp: ranks.
    rank: the rank.
    microbatches: micro-batches per step.
    chunks: chunks per rank.
    group: micro-batches per group.

  Returns:
    min((pp - rank - 1) * 2 + (chunks - 1) * group, microbatches * chunks).
  """
  return min((pp - rank - 1) * 2 + (chunks - 1) * group, microbatches * chunks)


def interleaved_1f1b(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """Megatron's interleaved 1F1B.

  Args:
    pp: ranks, p.
    microbatches: m.
    chunks: chunks per rank, v >= 2; None: 2.
    **options: `group`, micro-batches per group (default pp), in [p, m], with m % group 0 or
      >= p.

  Returns:
    The `Schedule`, on `Placement.interleaved(pp, v)`.

  Raises:
    ValueError: another option, v below 2, or a group out of range or leaving a short last
      group.
  """
  group = options.pop("group", None)
  _no_options("interleaved-1f1b (besides group)", options)
  v = 2 if chunks is None else chunks
  p, m = pp, microbatches
  if v < 2:
    raise ValueError(
        f"interleaved-1f1b needs chunks >= 2, got chunks={v}; for one chunk per rank use '1f1b'"
    )
  g = p if group is None else group
  if not isinstance(g, int) or not p <= g <= m:
    raise ValueError(
        f"interleaved-1f1b: group={g!r} (micro-batches per group) must lie in "
        f"[pp, microbatches] = [{p}, {m}]"
        + ("; use at least pp micro-batches" if m < p else "; pass group in range")
    )
  if 0 < m % g < p:
    raise ValueError(
        f"interleaved-1f1b: microbatches % group = {m} % {g} = {m % g}, which must "
        f"be 0 or >= pp={p} (a short last group leaves dependency bubbles); "
        f"choose microbatches a multiple of {g} or change group"
    )
  table = schedule_table(m, v, g)
  total = m * v
  ranks = []
  for r in range(p):
    fwd = [Action("F", c * p + r, mb) for mb, c in table]
    bwd = [Action("B", (v - 1 - c) * p + r, mb) for mb, c in table]
    w = interleaved_warmup(p, r, m, v, g)
    ops: list[Op] = fwd[:w]
    for k in range(total - w):
      ops += [fwd[k + w], bwd[k]]
    ops += bwd[total - w :]
    ranks.append(ops)
  return Schedule(
      "interleaved-1f1b", Placement.interleaved(p, v), m, ranks, options={"chunks": v, "group": g}
  )
