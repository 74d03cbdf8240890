"""The engine's compiled step programs, one per (padded tokens, padded pages per sequence).

A step's arrays are padded to a bucket of tokens and of pages per sequence (`serve.batch`), so
the programs an engine ever compiles are bounded by the product of the two bucket lists. Each
is compiled ahead of time from shapes, once, and kept. Steps whose rows use optional sampling
controls (min-p, logit bias, penalties, a grammar's mask) take a variant of their shape's
program for each `sampling.controls_key` they bring (widths padded to powers of two). A step
with a grammar's mask runs as two programs, the model's and the sampling's (`get_split`), so
that the host fills the mask between their dispatches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.serve import batch as batch_lib
from jaxpipe.serve import model as model_lib
from jaxpipe.serve import sampling as sampling_lib


class StepPrograms:
  """The compile cache of one engine's step (`Engine.compiled`)."""

  def __init__(
      self,
      cfg: TransformerConfig,
      backend: str,
      matmul: str,
      mesh: Mesh,
      max_batch: int,
      shardings: tuple,
      ring: bool,
      hidden: bool = False,
  ):
    """Args:
    cfg: the serving model.
    backend: the step's attention backend.
    matmul: the GEMM of its projections, resolved (`ops.matmul`): 'xla' or 'onednn'.
    mesh: the engine's devices.
    max_batch: the sampled rows of a step.
    shardings: (parameters' tree, the K/V pools' `KVPages`, the replicated sharding).
    ring: whether the model keeps rings of pages for sliding-window layers (their block tables
      are part of the step's batch).
    hidden: the programs also return every token's last hidden states (what an MTP drafter
      continues: `serve.mtp_drafter`), before the pools.
    """
    self.cfg, self.backend, self.mesh, self.max_batch = cfg, backend, mesh, max_batch
    self.matmul = matmul
    self._params, self._kv, self._replicated = shardings
    self.ring, self.hidden = ring, hidden
    self._compiled: dict[tuple, jax.stages.Compiled] = {}
    self._forward: dict[tuple, jax.stages.Compiled] = {}  # `get_split`'s halves
    self._sample: dict[tuple, jax.stages.Compiled] = {}

  @property
  def shapes(self) -> list[tuple[int, int]]:
    """(tokens, pages per sequence) of every program compiled so far (a shape's variants with
    sampling controls count once)."""
    return sorted({key[:2] for key in (*self._compiled, *self._forward)})

  @property
  def variants(self) -> int:
    """Programs compiled so far, sampling-control variants and split halves included."""
    return len(self._compiled) + len(self._forward) + len(self._sample)

  def _batch_shapes(self, t: int, n: int, drafts: int) -> model_lib.TokenBatch:
    """The step's `TokenBatch` as shapes (drafts: per row, in a verify step)."""
    r = batch_lib.row_count(t, self.max_batch)
    rings = (_i32(t), _i32(t, n), _i32(r, n)) if self.ring else (None,) * 3
    return model_lib.TokenBatch(
        _i32(t),
        _i32(t),
        _i32(t),
        _i32(t, n),
        _i32(r * (drafts + 1)),  # the rows wanted: each draft's too in a verify step
        _i32(r, n),
        _i32(r),
        _i32(r),
        _i32(r),
        _i32(t),
        *rings,
    )

  def _outputs(self, sampled: tuple, logprobs: bool) -> tuple:
    """`serve_sample`'s outputs as a program returns them: the sampled tokens padded to
    `max_batch` rows (the next step's prev_R, whatever its rows), logprobs None unless asked."""
    new_R, finite_R, *top = sampled
    pad = [(0, self.max_batch - new_R.shape[0])] + [(0, 0)] * (new_R.ndim - 1)
    return jnp.pad(new_R, pad), finite_R, top[0] if logprobs else None

  def get(
      self, t: int, n: int, params, kv, controls: tuple | None = None, logprobs: bool = False
  ) -> jax.stages.Compiled:
    """The compiled step for t tokens and n pages per sequence, compiled on first use.

    Args:
      t: padded tokens.
      n: padded pages per sequence.
      params: the engine's parameters (their shapes and shardings).
      kv: the engine's K/V pools (likewise).
      controls: the step's `sampling.controls_key`; None: no optional controls.
      logprobs: whether a row of the step wants log-probabilities (a variant computes them).

    Returns:
      `program(params, kv, TokenBatch, SamplingBatch, prev_R) -> (new_R, finite_R, logprobs,
      kv)` (new_R: `max_batch` rows, the step's `batch.row_count(t)` first; logprobs:
      `sampling.top_logprobs` of every row, or None; prev_R: the previous step's new_R, read
      where `TokenBatch.prev_T` says; with `hidden`, the states before kv). The pools are
      donated: the caller keeps the returned ones.
    """
    controls = controls or sampling_lib.controls_key(sampling_lib.batch_shapes(1))
    key = (t, n, controls, logprobs)
    if key not in self._compiled:
      r = batch_lib.row_count(t, self.max_batch)

      def step(params, kv, batch, sampling, prev_R):
        out = model_lib.serve_step(
            self.cfg,
            params,
            kv,
            batch,
            sampling,
            prev_R,
            backend=self.backend,
            mesh=self.mesh,
            logprobs=logprobs,
            hidden=self.hidden,
        )
        sampled = 3 if logprobs else 2
        return (*self._outputs(out[:sampled], logprobs), *out[sampled:])

      rep = self._replicated
      program = jax.jit(
          step,
          donate_argnums=1,
          in_shardings=(self._params, self._kv, rep, rep, rep),
          out_shardings=(rep, rep, rep, *(rep,) * self.hidden, self._kv),
      )
      sampling = sampling_lib.batch_shapes(r, controls, self.cfg.vocab)
      prev = _i32(self.max_batch)
      with matmul_lib.backend(self.matmul):  # read while tracing
        lowered = program.lower(params, kv, self._batch_shapes(t, n, controls[4]), sampling, prev)
      self._compiled[key] = lowered.compile()
    return self._compiled[key]

  def get_split(
      self, t: int, n: int, params, kv, controls: tuple, logprobs: bool = False
  ) -> tuple[jax.stages.Compiled, jax.stages.Compiled]:
    """The step for t tokens and n pages per sequence as two programs, the model's and the
    sampling's, so that the host can work between them (a grammar's masks: `Engine.launch`).

    Args:
      t: padded tokens.
      n: padded pages per sequence.
      params: the engine's parameters (their shapes and shardings).
      kv: the engine's K/V pools (likewise).
      controls: the step's `sampling.controls_key`.
      logprobs: whether a row of the step wants log-probabilities.

    Returns:
      (`forward(params, kv, TokenBatch, prev_R) -> (logits, kv)`, the pools donated (with
      `hidden`, the states before kv);
      `sample(logits, SamplingBatch, prev_R) -> (new_R, finite_R, logprobs)`), each compiled on
      first use: together they compute what `get`'s program does.
    """
    r, drafts, rep = batch_lib.row_count(t, self.max_batch), controls[4], self._replicated
    forward_key, sample_key = (t, n, drafts), (r, controls, logprobs)
    prev = _i32(self.max_batch)
    if forward_key not in self._forward:
      step = functools.partial(
          model_lib.serve_forward,
          self.cfg,
          backend=self.backend,
          mesh=self.mesh,
          hidden=self.hidden,
      )
      program = jax.jit(
          step,
          donate_argnums=1,
          in_shardings=(self._params, self._kv, rep, rep),
          out_shardings=(rep, *(rep,) * self.hidden, self._kv),
      )
      with matmul_lib.backend(self.matmul):  # read while tracing
        lowered = program.lower(params, kv, self._batch_shapes(t, n, drafts), prev)
      self._forward[forward_key] = lowered.compile()
    if sample_key not in self._sample:

      def sample(logits, sampling, prev_R):
        out = model_lib.serve_sample(logits, sampling, prev_R, logprobs=logprobs)
        return self._outputs(out, logprobs)

      logits = jax.ShapeDtypeStruct((r * (drafts + 1), self.cfg.vocab), jnp.float32)
      sampling = sampling_lib.batch_shapes(r, controls, self.cfg.vocab)
      self._sample[sample_key] = (
          jax.jit(sample, in_shardings=(rep, rep, rep), out_shardings=(rep, rep, rep))
          .lower(logits, sampling, prev)
          .compile()
      )
    return self._forward[forward_key], self._sample[sample_key]


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
  """An int32 array's shape."""
  return jax.ShapeDtypeStruct(shape, jnp.int32)
