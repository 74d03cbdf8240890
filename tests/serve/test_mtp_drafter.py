"""Speculative decoding with the model's own MTP module (`jaxpipe.serve.mtp_drafter`): every
draft the engine proposes against a recompute of the module over the whole sequence (dense
causal attention, the target's states from the training forward, the first draft also from
`models.mtp.logits`, which tests/models/test_deepseek_v3.py holds equal to transformers'
`MtpModel`); greedy tokens against the plain recompute; pages back on both pools."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import mtp, transformer
from jaxpipe.models.layers import rms_norm
from jaxpipe.serve import model as model_lib
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.sampling import SamplingParams
from jaxpipe.serve.speculative import SpecConfig
from tests import helpers

K = 3  # drafts per step
WIDTH = helpers.CONTEXT + K  # the recompute's padded length (causal: padding after is moot)


@functools.cache
def _module(name):
  """(the target's states before the final norm, the module over padded [1, WIDTH] rows:
  (its layer's output, its logits)), jitted."""
  cfg = model_lib.serving_config(helpers.CONFIGS[name])
  params = helpers.engine_params(name)
  p = mtp.module(params, 1)
  block = transformer.Block(cfg, moe=cfg.moe is not None)

  def run(tokens_1xL, states_1xLxD):
    x = mtp.module_input(cfg, params, p, tokens_1xL, states_1xLxD)
    out = block.apply({"params": p["block"]}, x, jnp.arange(WIDTH))
    out = out[0] if cfg.moe is not None else out
    return out, mtp.module_logits(cfg, params, p, out)

  hidden = lambda tokens: transformer.hidden_and_aux(cfg, params, tokens)[0]
  first = lambda h, ahead: mtp.logits(cfg, params, h, ahead)
  return cfg, params, jax.jit(hidden), jax.jit(run), jax.jit(first)


def _want_drafts(name, seq, k):
  """The module's k greedy drafts after seq (positions 0..len-2 computed by the target, the
  last token just sampled): the layer over every position, each new one continuing from the
  layer's own output at the one before, recomputed whole for each draft."""
  cfg, params, hidden, run, first = _module(name)
  n = len(seq) - 1
  tokens = np.zeros((1, WIDTH), np.int32)
  tokens[0, :n] = seq[:n]
  h = hidden(tokens)  # causal: positions < n are the target's states of seq
  ahead = np.zeros((1, 1, WIDTH), np.int32)
  ahead[0, 0, :n] = seq[1:]
  want_first = int(np.argmax(np.asarray(first(h, ahead))[0, 0, n - 1]))
  states = np.array(rms_norm(h, params["final_norm"]["scale"], cfg.norm_eps, cfg.norm_plus_one))
  tokens = ahead[0].copy()  # position i reads x_{i+1}
  drafts = []
  for j in range(k):
    out, logits = run(tokens, states)
    d = int(np.argmax(np.asarray(logits)[0, n - 1 + j]))
    drafts.append(d)
    tokens[0, n + j] = d
    states[0, n + j] = np.asarray(out)[0, n - 1 + j]  # the chained state: the layer's output
  assert drafts[0] == want_first
  return drafts


def _serve(name, prompts, max_tokens, **engine_fields):
  """The engine's requests, and every proposal (the request's tokens then, its drafts)."""
  engine = Engine(
      helpers.CONFIGS[name],
      helpers.engine_params(name),
      speculative=SpecConfig(method="mtp", num_tokens=K),
      nan_freed_pages=True,
      **{**helpers.ENGINE_ARGS, **engine_fields},
  )
  proposals = []
  propose = engine._drafter.propose

  def spy(requests, limits):
    out = propose(requests, limits)
    proposals.extend((list(r.tokens), k, d) for r, k, d in zip(requests, limits, out))
    return out

  engine._drafter.propose = spy
  ids = [engine.add_request(p, max_tokens, SamplingParams(), eos_id=None) for p in prompts]
  while engine.has_work():
    engine.step()
  return engine, [engine.requests[i] for i in ids], proposals


@pytest.mark.parametrize("name", ["dense_mtp", "mla_mtp"])
def test_drafts_are_the_modules_and_greedy_tokens_the_plain_engines(name):
  """Six requests in a pool small enough to preempt them: every proposal equals the
  recompute's drafts, and the outputs the plain recompute's."""
  prompts = helpers.prompts(seed=3, n=6)
  engine, got, proposals = _serve(name, prompts, 10, num_pages=14)
  assert [r.output for r in got] == helpers.oracle(name, prompts, 10)
  drafted = [(seq, k, d) for seq, k, d in proposals if d]
  assert len(drafted) >= 20 and all(len(d) == k for _, k, d in drafted)
  for seq, k, d in drafted:
    assert d == _want_drafts(name, seq, K)[:k], seq
  assert sum(r.preemptions for r in got) > 0
  # verified: those the step's token budget and the pool let through
  assert 20 <= engine.counts["spec_drafts"] <= sum(len(d) for *_, d in drafted)
  helpers.check_pages(engine)
  drafter = engine._drafter
  assert drafter.allocator.num_free == drafter.allocator.num_pages - 1  # every module page back
  assert not drafter.mirrors


def test_a_request_whose_prefix_was_cached_does_not_speculate():
  """The module has no entries for positions taken from the prefix cache: the request decodes
  without drafts (lost), and the others keep theirs."""
  shared = list(range(1, 13))  # three full pages
  engine = Engine(
      helpers.CONFIGS["dense_mtp"],
      helpers.engine_params("dense_mtp"),
      speculative=SpecConfig(method="mtp", num_tokens=K),
      **helpers.ENGINE_ARGS,
  )
  first = engine.generate([shared + [20]], 4)
  engine.finished()
  rid = engine.add_request(shared + [30, 31], 6, SamplingParams(), eos_id=None)
  while engine.has_work():
    engine.step()
  r = engine.requests[rid]
  assert r.cached_tokens == 12 and engine._drafter.counts["lost"] == 1
  assert r.output == helpers.oracle("dense_mtp", [shared + [30, 31]], 6)[0]
  assert first[0] == helpers.oracle("dense_mtp", [shared + [20]], 4)[0]


def test_every_draft_is_kept_when_the_module_and_the_model_agree():
  """A zero output head makes every logit equal, so the model and the module both pick token
  0: each verify step keeps all K drafts and emits K + 1 tokens, and the module's entries follow
  spans of K + 1 kept tokens."""
  cfg, params = helpers.CONFIGS["dense_mtp"], helpers.engine_params("dense_mtp")
  head = "embed" if cfg.tied_embeddings else "head"  # the output head (`transformer.project`)
  flat = dict(params, **{head: jnp.zeros_like(params[head])})
  engine = Engine(
      cfg, flat, speculative=SpecConfig(method="mtp", num_tokens=K), **helpers.ENGINE_ARGS
  )
  out = engine.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], 1 + 3 * (K + 1))
  assert out == [[0] * (1 + 3 * (K + 1))] * 3
  assert engine.counts["spec_drafts"] == engine.counts["spec_accepted"] == 3 * 3 * K
  assert engine.steps == 1 + 3  # the prompts, then three verify steps of K + 1 tokens each
  helpers.check_pages(engine)


def test_mtp_needs_the_modules_and_one_device():
  with pytest.raises(ValueError, match="mtp_depth=0.*'ngram' or 'draft'"):
    Engine(
        helpers.DENSE,
        helpers.engine_params("dense"),
        speculative=SpecConfig(method="mtp"),
        **helpers.ENGINE_ARGS,
    )
  with pytest.raises(ValueError, match="method='mtp' with drafter.*'ngram' and 'mtp' none"):
    SpecConfig(method="mtp", drafter=object())


def test_mtp_refuses_tensor_parallel_devices():
  devices = jax.devices()[:2]
  with pytest.raises(ValueError, match="runs on one device, not the 2 given"):
    Engine(
        helpers.CONFIGS["dense_mtp"],
        helpers.engine_params("dense_mtp"),
        speculative=SpecConfig(method="mtp"),
        devices=devices,
        **helpers.ENGINE_ARGS,
    )
