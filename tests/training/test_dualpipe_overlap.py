"""DualPipe's point: within an F&B tick the forward chunk's dispatch and combine all-to-alls do
not depend on the backward chunk's compute, nor the backward's on the forward's.

On the lowered program of a DualPipeV step at pp 2 x ep 2 (an MoE FFN in every layer, experts
over ep): inside the tick loop's body the forward's part and the backward's part are each one
loop (`tick/F`, `tick/B`) holding their chunk's all-to-alls; neither reads a value the other
writes, so XLA's scheduler may run one chunk's all-to-alls under the other's GEMMs. The same
check finds the edge in the executor as it was before (the backward passing the residual and
cotangent buffers on to the forward).
"""

import dataclasses

import jax
import pytest

from jaxpipe.pipeline import api, executor
from jaxpipe.training.trainer import Trainer
from tests import helpers


def _tick_body(jaxpr) -> jax.extend.core.Jaxpr:
  """The body of the executor's tick loop: the scan whose body holds the `tick/F` loop."""
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      if eqn.primitive.name == "scan" and any("tick/F" in _scope(e) for e in sub.eqns):
        return sub
      found = _tick_body(sub)
      if found is not None:
        return found
  return None


def _scope(eqn) -> str:
  return str(eqn.source_info.name_stack)


def _collectives(eqn) -> set[str]:
  """The collective primitives inside an equation's sub-programs."""
  names = set()
  for sub in jax.extend.core.jaxprs_in_params(eqn.params):
    for e in sub.eqns:
      if e.primitive.name in ("all_to_all", "ppermute", "psum", "all_gather"):
        names.add(e.primitive.name)
      names |= _collectives(e)
  return names


def _depends(body, later, earlier) -> bool:
  """Whether equation `later` reads, through any chain of equations of `body`, what `earlier`
  writes."""
  made_by = {}
  for i, eqn in enumerate(body.eqns):
    for v in eqn.outvars:
      made_by[v] = i
  target, seen = body.eqns.index(earlier), set()
  stack = [body.eqns.index(later)]
  while stack:
    i = stack.pop()
    for v in body.eqns[i].invars:
      j = made_by.get(v) if isinstance(v, jax.extend.core.Var) else None
      if j is None or j in seen:
        continue
      if j == target:
        return True
      seen.add(j)
      stack.append(j)
  return False


def _parts(trainer):
  """The tick body's F and B loops, from the lowered step."""
  params = helpers.random_params(trainer.model_cfg)
  batch = trainer.batch(0)
  jaxpr = jax.make_jaxpr(trainer.loss_and_grads)(trainer.stored_params(params), batch)
  body = _tick_body(jaxpr.jaxpr)
  assert body is not None
  loop = lambda name: [
      e for e in body.eqns if e.primitive.name == "while" and _scope(e).endswith(name)
  ]
  (f,), (b,) = loop("tick/F"), loop("tick/B")
  return body, f, b


@pytest.fixture(scope="module")
def trainer():
  c = helpers.path_config(pp=2)  # 2 layers with an MoE FFN each, dp = ep = 2
  c.pipeline.schedule, c.pipeline.microbatches = "dualpipev", 4
  c.model.n_layers = 4  # one layer per DualPipeV stage
  c.data.batch = 16
  c.model.moe.dispatch, c.model.moe.dropless_impl = "dropless", "padded"
  t = Trainer(c)
  assert dict(t.mesh.shape)["ep"] == 2
  return t


def test_the_forward_and_backward_chains_of_an_f_and_b_tick_are_independent(trainer):
  body, f, b = _parts(trainer)
  assert "all_to_all" in _collectives(f) and "all_to_all" in _collectives(b)
  assert not _depends(body, f, b), "the forward's loop reads what the backward's writes"
  assert not _depends(body, b, f), "the backward's loop reads what the forward's writes"


def _clear_caches():
  api._program.cache_clear()
  executor._make_executor.cache_clear()
  jax.clear_caches()  # jit's traces of the step too


def test_the_check_finds_the_edge_of_shared_buffers(trainer, monkeypatch):
  """The executor as it was: the backward's loop passed `res` and `cot` on to the forward's,
  which then waited for the whole backward."""
  of = executor._TickPlan.of
  coupled = lambda cls, spec: dataclasses.replace(of(spec), shared_link=True)
  monkeypatch.setattr(executor._TickPlan, "of", classmethod(coupled))
  _clear_caches()
  try:
    body, f, b = _parts(trainer)
  finally:
    monkeypatch.undo()
    _clear_caches()  # no later test may reuse the coupled executor
  assert _depends(body, f, b)
