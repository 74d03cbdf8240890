"""The engine's compiled step programs, one per (padded tokens, padded pages per sequence).

A step's arrays are padded to a bucket of tokens and of pages per sequence (`serve.batch`), so
the programs an engine ever compiles are bounded by the product of the two bucket lists. Each
is compiled ahead of time from shapes, once, and kept. Steps whose rows use optional sampling
controls (min-p, logit bias, penalties, a grammar's mask) take a variant of their shape's
program for each `sampling.controls_key` they bring (widths padded to powers of two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.serve import model as model_lib
from jaxpipe.serve import sampling as sampling_lib


class StepPrograms:
  """The compile cache of one engine's step (`Engine.compiled`)."""

  def __init__(
      self,
      cfg: TransformerConfig,
      backend: str,
      mesh: Mesh,
      max_batch: int,
      shardings: tuple,
      ring: bool,
  ):
    """Args:
    cfg: the serving model.
    backend: the step's attention backend.
    mesh: the engine's devices.
    max_batch: the sampled rows of a step.
    shardings: (parameters' tree, the K/V pools' `KVPages`, the replicated sharding).
    ring: whether the model keeps rings of pages for sliding-window layers (their block tables
      are part of the step's batch).
    """
    self.cfg, self.backend, self.mesh, self.max_batch = cfg, backend, mesh, max_batch
    self._params, self._kv, self._replicated = shardings
    self.ring = ring
    self._compiled: dict[tuple, jax.stages.Compiled] = {}

  @property
  def shapes(self) -> list[tuple[int, int]]:
    """(tokens, pages per sequence) of every program compiled so far (a shape's variants with
    sampling controls count once)."""
    return sorted({key[:2] for key in self._compiled})

  @property
  def variants(self) -> int:
    """Programs compiled so far, sampling-control variants included."""
    return len(self._compiled)

  def get(self, t: int, n: int, params, kv, controls: tuple | None = None) -> jax.stages.Compiled:
    """The compiled step for t tokens and n pages per sequence, compiled on first use.

    Args:
      t: padded tokens.
      n: padded pages per sequence.
      params: the engine's parameters (their shapes and shardings).
      kv: the engine's K/V pools (likewise).
      controls: the step's `sampling.controls_key`; None: no optional controls.

    Returns:
      `program(params, kv, TokenBatch, SamplingBatch, prev_R) -> (new_R, finite_R, logprobs,
      kv)` (logprobs: `sampling.top_logprobs` of every row; prev_R: the previous step's new_R,
      read where `TokenBatch.prev_T` says). The pools are donated: the caller keeps the
      returned ones.
    """
    key = (t, n, controls or sampling_lib.controls_key(sampling_lib.batch_shapes(1)))
    if key not in self._compiled:
      r = self.max_batch
      step = functools.partial(
          model_lib.serve_step, self.cfg, backend=self.backend, mesh=self.mesh, logprobs=True
      )
      i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
      rings = (i32(t), i32(t, n), i32(r, n)) if self.ring else (None,) * 3
      batch = model_lib.TokenBatch(
          i32(t),
          i32(t),
          i32(t),
          i32(t, n),
          i32(r * (key[2][4] + 1)),  # the rows wanted: each draft's too in a verify step
          i32(r, n),
          i32(r),
          i32(r),
          i32(r),
          i32(t),
          *rings,
      )
      sampling = sampling_lib.batch_shapes(r, key[2], self.cfg.vocab)
      rep = self._replicated
      self._compiled[key] = (
          jax.jit(
              step,
              donate_argnums=1,
              in_shardings=(self._params, self._kv, rep, rep, rep),
              out_shardings=(rep, rep, rep, self._kv),
          )
          .lower(params, kv, batch, sampling, i32(r))
          .compile()
      )
    return self._compiled[key]
