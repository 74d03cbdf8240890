"""Log-probabilities, prompt scoring, EOS and stop ids, and min_tokens against independent oracles.

Generated tokens' log-probabilities (and their top-k alternatives) must equal
`jax.nn.log_softmax` of the training forward pass recomputed over the whole sequence, whatever
the sampler did (greedy or temperature + top-k), inside a shared batch and across preemptions,
on one engine and across deployments' handoffs; `Engine.score` must equal transformers' own
`log_softmax(model(ids).logits)` on a converted checkpoint. min_tokens is checked against the
recompute oracle with the EOS and stop logits at -inf for the first min_tokens tokens
(transformers' `min_new_tokens`).
"""

import jax
import numpy as np
import pytest

from jaxpipe.serve import Engine, SamplingParams
from jaxpipe.serve.deploy import Colocated, Disaggregated
from jaxpipe.serve.sampling import MAX_BANNED
from tests import helpers

CONTEXT = helpers.CONTEXT


@pytest.fixture(scope="module")
def engine():
  """A small pool (preemption happens) whose freed pages are NaN."""
  return Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=17,
      nan_freed_pages=True,
      **helpers.ENGINE_ARGS,
  )


def run(engine, prompts, max_tokens, samplings, eos_id=None):
  """Adds every request at once (one shared batch), steps until all finish; checks that what a
  step reports for a request is the tail of its `logprobs` (what the HTTP loop streams)."""
  ids = [engine.add_request(p, max_tokens, sp, eos_id=eos_id) for p, sp in zip(prompts, samplings)]
  streamed = {i: [] for i in ids}
  while engine.has_work():
    for rid, tokens in engine.step().items():
      streamed[rid] += engine.requests[rid].logprobs[-len(tokens) :]
    helpers.check_pages(engine)
  done = {r.id: r for r in engine.finished()}
  assert all(streamed[i] == done[i].logprobs for i in ids)
  return [done[i] for i in ids]


def oracle_logprobs(prompts, outputs):
  """log_softmax of the training forward's logits over each whole sequence: [N, CONTEXT, V]."""
  tokens = np.zeros((len(prompts), CONTEXT), np.int32)
  for i, (p, o) in enumerate(zip(prompts, outputs)):
    tokens[i, : len(p) + len(o)] = p + o
  return np.asarray(jax.nn.log_softmax(helpers.forward("dense")(tokens), axis=-1))


def assert_logprobs(r, want_TxV):
  """r.logprobs equal the oracle's at each generated position: the chosen token's and the top
  k (ids exactly, values to float32 rounding), most likely first."""
  k = r.sampling.logprobs
  assert len(r.logprobs) == len(r.output)
  for i, (token, (chosen, top)) in enumerate(zip(r.output, r.logprobs)):
    want_V = want_TxV[len(r.prompt) - 1 + i]
    order = np.argsort(-want_V, kind="stable")[:k]
    helpers.close(chosen, want_V[token], f"token {i}")
    assert [t for t, _ in top] == order.tolist(), f"token {i}"
    if k:
      helpers.close([x for _, x in top], want_V[order], f"token {i} top {k}")


def test_generated_logprobs_equal_the_recompute_oracle(engine):
  prompts = helpers.prompts(seed=3, n=8)
  samplings = [
      SamplingParams(logprobs=5),
      SamplingParams(temperature=0.8, top_k=10, seed=1, logprobs=20),
      SamplingParams(logprobs=None),
      SamplingParams(temperature=0.8, top_k=10, seed=2, logprobs=0),
  ] * 2
  got = run(engine, prompts, 12, samplings)
  assert any(r.preemptions for r in got if r.sampling.logprobs is not None)
  assert all(r.logprobs == [] for r in got if r.sampling.logprobs is None)
  want = oracle_logprobs(prompts, [r.output for r in got])
  for i, r in enumerate(got):
    if r.sampling.logprobs is not None:
      assert_logprobs(r, want[i])
  # the sampled requests' logprobs are the raw distribution's, not the tempered one's
  sampled = got[1]
  scaled = np.asarray(jax.nn.log_softmax(want[1] / 0.8, axis=-1))  # log_softmax(logits / T)
  first = scaled[len(sampled.prompt) - 1, sampled.output[0]]
  assert abs(sampled.logprobs[0][0] - first) > 1e-3


def test_only_a_step_whose_rows_want_logprobs_computes_them():
  """A step program computes log-probabilities (log-softmax and top-k over the vocabulary) only
  where a row of the step asked: requests without them run the variant that returns None, and a
  request asking mid-way gets its steps' right (the recompute oracle)."""
  engine = Engine(helpers.DENSE, helpers.engine_params("dense"), **helpers.ENGINE_ARGS)
  calls, program = [], engine.step_program

  def program_(t, n, controls=None, logprobs=False):
    run = program(t, n, controls, logprobs)

    def call(*args):
      out = run(*args)
      calls.append((logprobs, out[2] is None))
      return out

    return call

  engine.step_program = program_
  prompts = helpers.prompts(seed=5, n=2)
  plain = run(engine, prompts[:1], 6, [SamplingParams()])
  assert calls and all(c == (False, True) for c in calls), calls
  calls.clear()
  got = run(engine, prompts, 6, [SamplingParams(), SamplingParams(logprobs=3)])
  assert got[0].output == plain[0].output and got[0].logprobs == []
  # the steps that sample its six tokens compute them (a prompt's first chunks sample nothing)
  assert sum(lp for lp, _ in calls) == 6 and all(lp != none for lp, none in calls), calls
  assert_logprobs(got[1], oracle_logprobs(prompts, [r.output for r in got])[1])


# -- prompt scoring against transformers ------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """(transformers' model, an engine serving the same checkpoint converted and restored)."""
  import torch  # the oracle, from the dev extra
  import transformers

  from jaxpipe.training import config as config_lib
  from jaxpipe.training import hf_workdir, restore

  root = tmp_path_factory.mktemp("llama")
  src = helpers.write_tiny_llama(root / "hf")
  hf_workdir.hf_to_orbax(src, str(root / "run"))
  config = restore.run_config(str(root / "run"))
  _, params = restore.restore_params(str(root / "run"), config)
  torch.set_num_threads(1)
  model = transformers.LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
  cfg = config_lib.model_config(config)
  return model, Engine(cfg, params, page_size=4, num_pages=9, max_batch=2, max_seq_len=32)


def transformers_logprobs(model, ids):
  import torch

  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].float()
  return torch.log_softmax(logits, dim=-1).numpy()  # [L, V]: row i scores token i + 1


def test_score_equals_transformers_log_softmax(llama):
  model, engine = llama
  rng = np.random.default_rng(0)
  for n, k in ((1, 0), (6, 3), (13, 20), (32, 5)):  # buckets 1, 8, 16 and the context, 32
    ids = rng.integers(0, engine.cfg.vocab, n).tolist()
    got = engine.score(ids, top_logprobs=k)
    want_LxV = transformers_logprobs(model, ids)
    assert len(got) == n and got[0] is None
    if n > 1:
      chosen = [c for c, _ in got[1:]]
      helpers.close(chosen, want_LxV[np.arange(n - 1), ids[1:]], f"{n}: chosen", rtol=1e-5)
    for i, (_, top) in enumerate(got[1:]):
      order = np.argsort(-want_LxV[i], kind="stable")[:k]
      assert [t for t, _ in top] == order.tolist()
      if k:
        helpers.close([x for _, x in top], want_LxV[i, order], f"{n} tokens: top", rtol=1e-5)
  assert engine.scorer.program._cache_size() == 4  # one program per length bucket
  assert engine.allocator.num_used == 0 and not engine.has_work()  # no pages touched


@pytest.mark.parametrize(
    "prompt, k, words",
    [
        ([], 0, "empty"),
        ([1, 384], 0, "token 384 is outside the vocabulary [0, 384)"),
        ([1] * 33, 0, "33 tokens, more than the context of 32"),
        ([1, 2], 21, "top_logprobs=21 must be an integer in [0, 20]"),
    ],
)
def test_score_refuses_a_bad_prompt_in_one_line(llama, prompt, k, words):
  with pytest.raises(ValueError, match=None) as e:
    llama[1].score(prompt, k)
  assert words in str(e.value) and "\n" not in str(e.value)


# -- deployments carry logprobs across the handoff --------------------------------------------


def test_deployments_carry_logprobs_across_the_handoff():
  d = jax.devices()
  kw = dict(num_pages=33, **helpers.ENGINE_ARGS)
  args = (helpers.DENSE, helpers.engine_params("dense"))
  deployments = [Colocated(*args, [d[0:1]], **kw), Disaggregated(*args, [d[1:2]], [d[2:3]], **kw)]
  prompts = helpers.prompts(seed=6, n=4)
  samplings = [
      SamplingParams(logprobs=3),
      SamplingParams(temperature=0.8, top_k=10, seed=5, logprobs=2),
  ] * 2
  results = []
  for dep in deployments:
    ids = [dep.add_request(p, 6, sp, eos_id=None) for p, sp in zip(prompts, samplings)]
    streamed = {i: [] for i in ids}
    while dep.has_work():
      for rid, tokens in dep.step().items():
        streamed[rid] += dep.requests[rid].logprobs[-len(tokens) :]
    done = {r.id: r for r in dep.finished()}
    assert all(streamed[i] == done[i].logprobs for i in ids)
    results.append([done[i] for i in ids])
  colo, dis = results
  assert all(r.transfers == 1 for r in dis)
  assert [r.output for r in colo] == [r.output for r in dis]
  want = oracle_logprobs(prompts, [r.output for r in colo])
  for i, (a, b) in enumerate(zip(colo, dis)):
    assert_logprobs(a, want[i])
    assert_logprobs(b, want[i])
  assert deployments[1].score(prompts[0], 2) == deployments[1].engines[0].score(prompts[0], 2)


# -- EOS ids, stop ids, min_tokens, sampling checks ---------------------------------------------


def greedy_oracle(prompt, max_tokens, banned=(), min_tokens=0, stops=()):
  """Greedy recompute loop; `banned` logits at -inf for the first min_tokens tokens (transformers'
  min_new_tokens); stops once it samples one of `stops` after min_tokens tokens."""
  seq, out = list(prompt), []
  while len(out) < max_tokens:
    tokens = np.zeros((1, CONTEXT), np.int32)
    tokens[0, : len(seq)] = seq
    logits_V = np.array(helpers.forward("dense")(tokens))[0, len(seq) - 1]
    if len(out) < min_tokens:
      logits_V[list(banned)] = -np.inf
    out.append(int(np.argmax(logits_V)))
    seq.append(out[-1])
    if out[-1] in stops and len(out) > min_tokens:
      break
  return out


def test_either_of_several_eos_ids_and_stop_token_ids_end_a_request(engine):
  prompts = helpers.prompts(seed=8, n=3)
  want = [greedy_oracle(p, 8) for p in prompts]

  def first_new(o, at):  # a token of o first seen at index `at`
    return next(i for i in range(at, len(o)) if o[i] not in o[:i])

  a, b = first_new(want[0], 2), first_new(want[1], 4)
  eos0 = (want[0][first_new(want[0], a + 1)], want[0][a])  # the second id comes first
  stop1 = want[1][b]
  ids = [
      engine.add_request(prompts[0], 8, eos_id=eos0),
      engine.add_request(prompts[1], 8, SamplingParams(stop_token_ids=(stop1,)), eos_id=None),
      engine.add_request(prompts[2], 8, eos_id=None),
  ]
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  got = [done[i] for i in ids]
  assert got[0].output == want[0][: a + 1] and got[0].finish_reason == "eos"
  assert got[1].output == want[1][: b + 1] and got[1].finish_reason == "eos"
  assert got[2].output == want[2] and got[2].finish_reason == "length"


def test_min_tokens_bans_eos_and_stop_ids_until_reached(engine):
  prompts = helpers.prompts(seed=9, n=2)
  plain = [greedy_oracle(p, 10) for p in prompts]
  eos = plain[0][0]  # the first request's greedy first token is its EOS
  stop = plain[1][1]
  cases = [
      (prompts[0], SamplingParams(min_tokens=4), eos),
      (prompts[1], SamplingParams(min_tokens=3, stop_token_ids=(stop,)), plain[1][0]),
  ]
  ids = [engine.add_request(p, 10, sp, eos_id=e) for p, sp, e in cases]
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  for rid, (p, sp, e) in zip(ids, cases):
    stops = (e, *sp.stop_token_ids)
    want = greedy_oracle(p, 10, banned=stops, min_tokens=sp.min_tokens, stops=stops)
    r = done[rid]
    assert r.output == want, (r.output, want)
    assert not set(r.output[: sp.min_tokens]) & set(stops)
    assert r.finish_reason == ("eos" if want[-1] in stops else "length")
  assert done[ids[0]].output[0] != eos and len(done[ids[0]].output) > 1


def test_min_tokens_counts_the_requests_own_eos_ids_not_the_engines(engine):
  """The banned-id limit holds a request's own EOS ids with its stop ids (the engine's EOS is not
  what it stops at): too many is one error, and a request within it runs and finishes."""
  prompt = helpers.prompts(seed=10, n=1)[0]
  stops = tuple(range(10, 10 + MAX_BANNED))
  sp = SamplingParams(min_tokens=1, stop_token_ids=stops)
  assert engine.check_request(prompt, 4, sp, eos_id=None) is None
  why = engine.check_request(prompt, 4, sp, eos_id=(1, 2))
  assert why is not None and f"holds back {MAX_BANNED + 2} EOS and stop ids" in why
  over = engine.add_request(prompt, 4, sp, eos_id=(1, 2))  # finished at once with the error
  ok = engine.add_request(prompt, 4, sp, eos_id=None)
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  assert done[over].finish_reason == "error" and "holds back" in done[over].error
  assert done[ok].finish_reason in ("eos", "length") and done[ok].error is None


@pytest.mark.parametrize(
    "sp, words",
    [
        (SamplingParams(temperature=100.5), "temperature=100.5 must lie in [0, 100]"),
        (SamplingParams(temperature=1e308), "temperature=1e+308"),
        (SamplingParams(temperature=float("inf")), "temperature=inf"),
        (SamplingParams(temperature=float("nan")), "temperature=nan"),
        (SamplingParams(logprobs=21), "logprobs=21 must be None or an integer in [0, 20]"),
        (SamplingParams(logprobs=-1), "logprobs=-1"),
        (SamplingParams(logprobs=2.0), "logprobs=2.0"),
    ],
)
def test_sampling_check_refuses_bad_values(sp, words):
  reason = sp.check()
  assert reason is not None and words in reason and "\n" not in reason
  assert SamplingParams(temperature=100.0, logprobs=20).check() is None
