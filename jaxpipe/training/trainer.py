"""Trainer: one optimizer step on a named mesh, and the loop around it (logging, eval, checkpoints).

The gradient computation is one replaceable function (`jaxpipe.training.losses`); everything
around it (optimizer, state, sharding, checkpoints) stays the same whichever function is chosen.
"""

import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.runtime import files, multihost
from jaxpipe.runtime.checkpoint import Checkpointer
from jaxpipe.runtime.metrics import MetricWriter
from jaxpipe.runtime.preemption import StopRequest
from jaxpipe.training import batches as data_lib
from jaxpipe.training import config as config_lib
from jaxpipe.training import zero
from jaxpipe.training.losses import make_loss_and_grads
from jaxpipe.training.mesh import batch_sharding, make_mesh, replicated
from jaxpipe.training.pipeline_lm import layer_order
from jaxpipe.training.resolve import ResolvedConfig, resolve
from jaxpipe.training.state import (
    TrainState,
    fresh_state,
    learning_rate,
    make_optimizer,
    reorder_layers,
)


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; the message names which, the steps and the
  checkpoint."""


class Trainer:
  """Trains the config's model on a named mesh; drives the same code from a script or a notebook.

    trainer = Trainer(config, workdir=None)   # resolves the config (`resolve`), builds the mesh
    trainer.init()                            # restores the latest checkpoint in workdir, or inits
    metrics = trainer.step()                  # one step on the next batch (or trainer.step(batch))
    trainer.state, trainer.mesh               # TrainState(step, params, opt_state, fp8); the Mesh
    summary = trainer.train()                 # full loop: progress bar, metrics, eval, checkpoints
    trainer.close()                           # waits for saves, releases the workdir (or `with`)

  With a workdir the trainer holds it (`jaxpipe.training.workdir`: one process at a time, one config
  per run) from construction to `close()`, so a second run, or a config that would train
  something else, fails before any device work.

  In a multi-process run (`jaxpipe.runtime.process.initialize`) every process builds the same
  Trainer and makes the same calls: process 0 holds the workdir and writes config.json, metrics and
  the progress bar; each process reads only its rows of each batch (`local_rows`) and writes its
  shards of each checkpoint; a stop signal to any process stops all after the same step. Read
  arrays split over other processes with `jaxpipe.runtime.multihost.to_host`.

  `trainer.loss_and_grads` may be replaced before the first step (it receives the state's
  params, in the stored order below). Steps donate the previous state's buffers: keep
  `trainer.state`, not an older reference.

  Under interleaved and V-shaped schedules `trainer.state` stacks params['layers'] (and their
  moments) in `trainer.layer_order`, rank by rank, so that no parameter moves inside a step;
  `trainer.loss_and_grads` takes them that way. Under bidirectional ones (Chimera, DualPipe)
  the state holds two resident copies of every layer, one on each rank that runs it (twice the
  parameter and moment memory): their gradients are summed between the two holders, they are
  updated alike and stay equal, and the clipping norm and `grad_norm` count each parameter once
  (`trainer.grad_norm`). `trainer.model_params()` gives the model's order (one copy) and
  `trainer.stored_params(params)` turns the model's order into the state's; checkpoints hold
  the model's order (any schedule restores them).
  """

  def __init__(
      self,
      config: ml_collections.ConfigDict | ResolvedConfig,
      workdir: str | None = None,
      existing_run: str = "resume",
  ):
    """Builds the loss, mesh, data and optimizer of a resolved config.

    Args:
      config: the run's config (`jaxpipe.training.config.default_config` and overrides),
        resolved here (`jaxpipe.training.resolve`: one that cannot run raises `ConfigError`
        naming the field and the fix), or a `ResolvedConfig`, whose workdir lock the trainer
        takes over.
      workdir: where checkpoints, metrics and config.json go; None: nothing is written. Only
        with an unresolved config.
      existing_run: what to do with a run the workdir already holds: 'resume' it (refused if the
        config changes what is trained, `jaxpipe.training.workdir`), 'resume_changed' (continue
        it under the changed config) or 'restart' (move it to previous-<n>/ and start over).
        Only with an unresolved config.
    """
    if isinstance(config, ResolvedConfig):
      if workdir is not None or existing_run != "resume":
        raise ValueError(
            "a ResolvedConfig carries its workdir and existing_run; pass them to resolve(), "
            "not to Trainer()"
        )
      run = config
    else:
      run = resolve(config, workdir, existing_run)
    self.resolved = run  # the config as it runs, and what resolving it found (properties below)
    config, workdir = run.config, run.workdir
    self.checkpointer = None
    self.layer_order = layer_order(config, self.model_cfg, self.mesh_shape)
    self._units = self._to_model = self._counted = None
    copies = False
    if self.layer_order is not None:
      self._units = int(self.layer_order.max()) + 1  # entries of the model's layer axis
      # the stored entry read for each of the model's units (its first copy)
      self._to_model = np.unique(self.layer_order, return_index=True)[1]
      copies = len(self.layer_order) != self._units
    if copies:  # [stored units] 1 on each unit's first copy, 0 on the other: counted once
      self._counted = np.zeros(len(self.layer_order), np.float32)
      self._counted[self._to_model] = 1.0
    self.loss_and_grads = make_loss_and_grads(
        config, self.model_cfg, self.mesh_shape, self.layer_order is not None
    )
    try:  # auto and onednn build the kernel here (once per machine: the build is cached)
      self.matmul = matmul_lib.resolve(config.train.matmul)
    except ValueError as e:
      raise config_lib.ConfigError(f"train.matmul: {e}") from e
    self.mesh = make_mesh(config.mesh)
    self.source = data_lib.make_source(config.data, self.model_cfg.vocab, workdir)
    self.optimizer = make_optimizer(
        config.optimizer, config.train.steps, self.grad_norm if copies else None
    )
    if workdir is not None:
      self.checkpointer = Checkpointer(
          os.path.join(workdir, "checkpoints"), config.checkpoint.keep, config.checkpoint.async_save
      )
    self.state: TrainState | None = None
    self.resumed_from: int | None = None
    self._batch_sharding = batch_sharding(self.mesh)
    self._state_sharding = None
    self._train_step = None
    self._eval_step = None
    self.compile_stats: dict[str, float] = {}  # set by compile(): seconds, bytes per device

  # What `resolve` found, read from the one place that holds it.

  @property
  def config(self) -> ml_collections.ConfigDict:
    """The config as it runs (pipeline.schedule='auto' replaced by the choice)."""
    return self.resolved.config

  @property
  def mesh_shape(self) -> dict[str, int]:
    """Devices per mesh axis."""
    return self.resolved.mesh_shape

  @property
  def model_cfg(self) -> transformer.TransformerConfig:
    """The model the config describes."""
    return self.resolved.model_cfg

  @property
  def workdir(self) -> str | None:
    """Where the run writes; None: nowhere."""
    return self.resolved.workdir

  @property
  def auto_report(self) -> str | None:
    """pipeline.schedule='auto': the ranking and why the choice won; else None."""
    return self.resolved.auto_report

  @property
  def notices(self) -> list[str]:
    """What the workdir check accepted and the user should know."""
    return self.resolved.notices

  def close(self) -> None:
    """Waits for background saves and releases the workdir (also done when garbage-collected)."""
    try:
      if self.checkpointer is not None:
        self.checkpointer.close()
    finally:
      self.resolved.close()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- state ------------------------------------------------------------------------------------

  def _fresh_state(self, rng: jax.Array, stored: bool = True) -> TrainState:
    params = transformer.init_params(self.model_cfg, rng)
    if stored and self.layer_order is not None:
      params = reorder_layers(params, self.layer_order, self._units)
    return fresh_state(self.model_cfg, self.optimizer, params)

  def grad_norm(self, grads: dict) -> jax.Array:
    """Global norm of a params-shaped tree, each parameter counted once (resident copies once).

    Args:
      grads: a tree with the structure of the state's params (e.g. gradients).

    Returns:
      The norm, a float32 scalar.
    """

    def squares(path, g):
      s = jnp.square(g.astype(jnp.float32))
      if self._counted is not None and "layers" in [getattr(k, "key", None) for k in path]:
        s = s * self._counted.reshape((-1,) + (1,) * (g.ndim - 1))  # local to each rank
      return jnp.sum(s)

    return jnp.sqrt(sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(squares, grads))))

  @functools.cached_property
  def _reorder(self) -> dict[str, Callable]:
    """Compiled-once moves of a state or params between the stored and the model's order."""
    stored, model = len(self.layer_order), self._units
    fn = lambda order, size, sharding: jax.jit(
        functools.partial(reorder_layers, order=order, size=size), out_shardings=sharding
    )
    to_model, to_stored = self._to_model, self.layer_order
    return {
        "state_to_model": fn(to_model, stored, self.model_state_sharding),
        "state_to_stored": fn(to_stored, model, self.state_sharding),
        "params_to_model": fn(to_model, stored, self.model_state_sharding.params),
        "params_to_stored": fn(to_stored, model, self.state_sharding.params),
    }

  def model_params(self, params: dict | None = None) -> dict:
    """A copy of `params` (default the state's) with the layers in the model's order.

    Args:
      params: params in the state's layer order; None: the state's.

    Returns:
      The copy, in the model's order.
    """
    params = self.state.params if params is None else params
    if self.layer_order is None:
      return jax.tree.map(jnp.copy, params)  # the next step donates the state's buffers
    return self._reorder["params_to_model"](params)

  def stored_params(self, params: dict) -> dict:
    """Model-order `params` (e.g. `transformer.init_params`) in the state's layer order.

    Args:
      params: params in the model's order.

    Returns:
      The params in the state's order (`params` itself where the two orders are the same).
    """
    if self.layer_order is None:
      return params
    return self._reorder["params_to_stored"](params)

  def _checkpoint_state(self) -> TrainState:
    """The state as checkpoints hold it: layers in the model's order."""
    if self.layer_order is None:
      return self.state
    return self._reorder["state_to_model"](self.state)

  @functools.cached_property
  def state_shapes(self) -> TrainState:
    """The TrainState's shapes and dtypes (traced, nothing computed)."""
    return jax.eval_shape(self._fresh_state, jax.random.key(0))

  @property
  def state_sharding(self) -> Any:
    """The TrainState's shardings (`state_shardings`): layers split over pp, experts over ep,
    Megatron's dimensions over tp; the moments (and under fsdp the parameters) over the data
    axes as `optimizer.shard` asks (`zero.train_state_shardings`)."""
    if self._state_sharding is None:
      self._state_sharding = zero.train_state_shardings(
          self.state_shapes, self.mesh, self.config.optimizer.shard
      )
    return self._state_sharding

  @functools.cached_property
  def model_state_shapes(self) -> TrainState:
    """The state's shapes and dtypes in the model's order (as checkpoints hold it)."""
    return jax.eval_shape(functools.partial(self._fresh_state, stored=False), jax.random.key(0))

  @functools.cached_property
  def model_state_sharding(self) -> Any:
    """Shardings of the state in the model's order (as checkpoints hold it)."""
    if self.layer_order is None or len(self.layer_order) == self._units:
      return self.state_sharding
    return zero.train_state_shardings(
        self.model_state_shapes, self.mesh, self.config.optimizer.shard
    )

  def init(self) -> TrainState:
    """Restores the newest readable checkpoint in the workdir, else initialises from train.seed."""
    restored = None
    if self.checkpointer is not None:
      abstract = jax.tree.map(
          lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
          self.model_state_shapes,
          self.model_state_sharding,
      )
      restored = self.checkpointer.restore_latest(abstract)
    if restored is not None:
      self.resumed_from, self.state = restored
      if self.layer_order is not None:  # checkpoints hold the model's order
        self.state = self._reorder["state_to_stored"](self.state)
    else:
      init = jax.jit(self._fresh_state, out_shardings=self.state_sharding)
      self.state = init(jax.random.key(self.config.train.seed))
    return self.state

  # -- batches ----------------------------------------------------------------------------------

  def shard_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Places a global numpy batch on the mesh (each device takes its slice).

    Args:
      host_batch: the whole batch, arrays [batch, seq_len].

    Returns:
      The same keys as global arrays on the mesh.
    """
    return {
        k: jax.make_array_from_callback(v.shape, self._batch_sharding, lambda idx, v=v: v[idx])
        for k, v in host_batch.items()
    }

  @functools.cached_property
  def local_rows(self) -> np.ndarray | None:
    """The rows of each batch that this process's devices hold, ascending; None when they hold
    every row (one process, or a batch axis that stays within processes)."""
    d = self.config.data
    index_map = self._batch_sharding.addressable_devices_indices_map((d.batch, d.seq_len))
    rows = np.unique(np.concatenate([np.arange(d.batch)[idx[0]] for idx in index_map.values()]))
    return None if len(rows) == d.batch else rows

  def batch(self, index: int, split: str = "train") -> dict[str, jax.Array]:
    """Batch `index` of `split`, on the mesh; training step s (0-based) uses train batch s.

    Across processes each process reads only the rows its devices hold (`local_rows`).

    Args:
      index: the batch's number.
      split: 'train' or 'eval'.

    Returns:
      The batch's arrays [data.batch, data.seq_len], global arrays on the mesh.
    """
    d = self.config.data
    rows = self.local_rows
    if rows is None:
      return self.shard_batch(self.source.batch(split, index, d.batch, d.seq_len))
    local = self.source.batch(split, index, d.batch, d.seq_len, rows=rows)
    return {
        k: jax.make_array_from_process_local_data(self._batch_sharding, v, (d.batch, d.seq_len))
        for k, v in local.items()
    }

  # -- one step ---------------------------------------------------------------------------------

  def build_train_step(self) -> Callable:
    """The train step (state, batch) -> (state, metrics), jitted for the state's and the batches'
    shardings (the state donated) but not compiled: `compile` and `step` run it, and lowering it
    on shapes (`state_shapes`) reads the program's HLO without initialising anything."""
    loss_and_grads, optimizer = self.loss_and_grads, self.optimizer
    lr = learning_rate(self.config.optimizer, self.config.train.steps)
    cfg = self.model_cfg
    # zero1: gradients all-reduced whole; zero2, fsdp: reduce-scattered onto the moments' split
    grad_sharding = zero.gradient_shardings(
        self.state_shapes.params, self.mesh, self.config.optimizer.shard
    )

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
      with matmul_lib.backend(self.matmul):  # read while tracing
        loss, grads, metrics = loss_and_grads(state.params, batch)
      if grad_sharding is not None:
        grads = jax.lax.with_sharding_constraint(grads, grad_sharding)
      history = state.fp8
      if history is not None:  # a delayed scale's "gradient" is the amax its GEMMs saw
        seen = fp8_lib.state_of(grads)
        grads = fp8_lib.with_state(grads, jax.tree.map(jnp.zeros_like, seen))
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      if "moe_tokens_per_expert" in metrics:  # balancing biases move by their own rule
        params = moe_lib.update_biases(
            self.model_cfg.moe, state.params, params, metrics.pop("moe_tokens_per_expert")
        )
      if history is not None:  # and the scales by TE's (the optimizer's update is discarded)
        scales, history = fp8_lib.advance(
            fp8_lib.state_of(state.params), history, seen, cfg.fp8_margin, cfg.fp8_amax
        )
        params = fp8_lib.with_state(params, scales)
      grad_norm = self.grad_norm(grads)
      metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "lr": lr(state.step)}
      return TrainState(state.step + 1, params, opt_state, history), metrics

    return jax.jit(
        train_step,
        in_shardings=(self.state_sharding, self._batch_sharding),
        out_shardings=(self.state_sharding, replicated(self.mesh)),
        donate_argnums=0,
    )

  def compile(self) -> jax.stages.Compiled:
    """Compiles the train step ahead of time for the state's and batches' shapes (later steps
    reuse it) and records `compile_stats`: seconds, and the compiled program's bytes per device
    from `memory_analysis()` (peak = arguments + outputs - donated aliases + temporaries)."""
    if self.state is None:
      self.init()
    if self._train_step is None:
      self._train_step = self.build_train_step()
    batch = self.batch(int(self.state.step))
    t0 = time.perf_counter()
    compiled = self._train_step.lower(self.state, batch).compile()
    stats = {"compile_s": time.perf_counter() - t0}
    mem = compiled.memory_analysis()
    if mem is not None:  # some backends do not report it
      sizes = {
          name: int(getattr(mem, f"{name}_size_in_bytes"))
          for name in ("argument", "output", "alias", "temp")
      }
      stats.update({f"{k}_bytes": v for k, v in sizes.items()})
      stats["peak_bytes"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    self.compile_stats = stats
    return compiled

  def step(self, batch: dict | None = None) -> dict[str, jax.Array]:
    """One optimizer step.

    Args:
      batch: `tokens`, `targets`, `mask` (and a packed batch's `segment_ids`, `positions`), numpy
        or on-mesh arrays [batch, seq_len]; default: the next train batch.

    Returns:
      The step's metrics (`loss`, `grad_norm`, `tokens`, ...) as arrays on the mesh.
    """
    if self.state is None:
      self.init()
    if batch is None:
      batch = self.batch(int(self.state.step))
    elif not all(isinstance(v, jax.Array) for v in batch.values()):
      batch = self.shard_batch({k: np.asarray(v) for k, v in batch.items()})
    if self._train_step is None:
      self._train_step = self.build_train_step()
    self.state, metrics = self._train_step(self.state, batch)
    return metrics

  def evaluate(self) -> float:
    """Mean per-token cross-entropy over `train.eval_batches` eval batches.

    Returns:
      The mean loss, as a Python float.

    Runs the training path's `loss_and_grads` and drops the gradients (XLA then drops the
    backward), so the loss is the one training reports and the layout is training's: layers
    stay split over pp (a plain forward would gather the whole stack on every device), the
    sequence over cp, experts over ep.
    """
    if self._eval_step is None:
      loss_and_grads = self.loss_and_grads

      def eval_step(params, batch):
        with matmul_lib.backend(self.matmul):
          loss, _, metrics = loss_and_grads(params, batch)
        return loss * metrics["tokens"], metrics["tokens"]

      self._eval_step = jax.jit(
          eval_step, in_shardings=(self.state_sharding.params, self._batch_sharding)
      )
    total = count = 0.0
    for i in range(self.config.train.eval_batches):
      s, n = jax.device_get(self._eval_step(self.state.params, self.batch(i, "eval")))
      total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)

  # -- the loop ---------------------------------------------------------------------------------

  def train(self, steps: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Trains up to step `steps`, resuming from the workdir.

    Args:
      steps: the step to stop at (default `train.steps`).
      progress: show a progress bar (process 0).

    Returns:
      {'start', 'step', 'first_loss', 'last_loss', 'eval_loss', 'preempted', 'stop_signal'}.

    SIGTERM or a first SIGINT (Ctrl-C) saves a checkpoint after the current step and returns with
    preempted=True and stop_signal naming the signal; a second SIGINT raises KeyboardInterrupt at
    once, without saving. A non-finite loss or gradient raises NonFiniteLossError naming which and
    the steps; nothing after the last finite step is saved. A checkpoint that cannot be written
    raises CheckpointSaveError as soon as that is known: before the first step when the disk has
    no room for one, else after the first step that ends once the failed write has; the last
    good checkpoint stays.
    """
    cfg = self.config
    total = cfg.train.steps if steps is None else steps
    if self.state is None:
      self.init()
    start = int(self.state.step)
    summary = {
        "start": start,
        "step": start,
        "first_loss": None,
        "last_loss": None,
        "eval_loss": None,
        "preempted": False,
        "stop_signal": None,
    }
    if start > total:
      where = f" (checkpoint in {self.checkpointer.directory})" if self.checkpointer else ""
      raise config_lib.ConfigError(
          f"the run stands at step {start}{where}, past the {total} steps asked for; nothing to "
          f"train. Raise train.steps above {start} (with --resume_changed) or pass another "
          "--workdir"
      )
    if start == total:
      return summary
    if self.checkpointer:
      self.checkpointer.check_space(self.model_state_shapes)
    self.compile()
    if self.workdir and jax.process_index() == 0:
      files.write_json(os.path.join(self.workdir, "compile.json"), self.compile_stats, indent=1)
    writer = MetricWriter(self.workdir, start) if self.workdir else None
    tokens_per_step = cfg.data.batch * cfg.data.seq_len
    pending: list[tuple[int, dict]] = []
    checked = start  # every step up to here had a finite loss and gradient
    bar = tqdm.tqdm(
        total=total,
        initial=start,
        dynamic_ncols=True,
        desc="train",
        disable=not progress or jax.process_index() != 0,
    )
    t_last, steps_last = None, start

    def flush(step: int) -> None:
      nonlocal checked, t_last, steps_last
      rows = jax.device_get(pending)
      pending.clear()
      block_start = checked + 1
      now = time.perf_counter()
      timing = {}
      if t_last is not None and step > steps_last:
        step_s = (now - t_last) / (step - steps_last)
        timing = {"step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s}
      t_last, steps_last = now, step  # the first interval holds compilation; it is not timed
      for s, m in rows:
        loss, norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(norm)):
          if writer:
            writer.write(s, {k: float(v) for k, v in m.items()})
            writer.close()
          if self.checkpointer:
            self.checkpointer.wait()
          good = self.checkpointer.latest_step() if self.checkpointer else None
          what = (
              f"non-finite loss {loss} (gradient norm {norm})"
              if not math.isfinite(loss)
              else f"non-finite gradient norm {norm} (the loss, {loss:.4f}, is finite)"
          )
          raise NonFiniteLossError(
              f"{what} at step {s}, found when checking steps {block_start}..{step}. Stopped "
              "without saving; the last good checkpoint is "
              + (f"step {good} in {self.checkpointer.directory}" if good is not None else "none")
              + ". Lower optimizer.lr, lengthen warm-up or clip harder, then resume with "
              "--resume_changed."
          )
        checked = s
        summary["last_loss"] = loss
        if summary["first_loss"] is None:
          summary["first_loss"] = loss
        if writer:
          writer.write(s, {**{k: float(v) for k, v in m.items()}, **(timing if s == step else {})})
      if writer:
        writer.flush()
      postfix = {"loss": f"{summary['last_loss']:.4f}"}
      if timing:
        postfix.update(
            tok_s=f"{timing['tokens_per_s']:.0f}", step_ms=f"{1e3 * timing['step_time_s']:.0f}"
        )
      bar.set_postfix(postfix, refresh=False)

    # Across processes every rank stops after the same step: the requests are agreed a step late.
    with StopRequest(multihost.OneStepLate() if jax.process_count() > 1 else None) as stop:
      try:
        for index in range(start, total):
          pending.append((index + 1, self.step(self.batch(index))))
          done = index + 1
          bar.update(1)
          if self.checkpointer:
            self.checkpointer.poll()  # a background save that failed stops the run now
          stopping = stop.agreed()  # read once: the signal may land anywhere in this iteration
          eval_now = cfg.train.eval_every and done % cfg.train.eval_every == 0
          save_now = self.checkpointer and (
              (cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
              or done == total
              or stopping
          )
          if (
              done % cfg.train.log_every == 0
              or done == total
              or eval_now
              or save_now
              or stopping
              or done == start + 1
          ):
            flush(done)
          if eval_now or (done == total and cfg.train.eval_every):  # 0: no evaluation at all
            summary["eval_loss"] = self.evaluate()
            if writer:
              writer.write(done, {"eval_loss": summary["eval_loss"]})
              writer.flush()
          if save_now:
            self.checkpointer.save(done, self._checkpoint_state(), force=bool(stopping))
          summary["step"] = done
          if stopping:
            summary["preempted"], summary["stop_signal"] = True, stopping
            break
      finally:
        bar.close()
        try:
          if self.checkpointer:
            self.checkpointer.wait()
        finally:
          if writer:
            writer.close()
    return summary
