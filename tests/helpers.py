"""Helpers that several test modules share: model and batch builders, oracles, runner plumbing."""

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.models.mla import MLAConfig
from jaxpipe.models.moe import MoEConfig
from jaxpipe.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# --- from training/test_losses_moe.py ----------------------------------------

MOE_KWARGS = dict(num_experts=8, top_k=2, d_ff=16, every=2, lb_loss_coef=0.1, z_loss_coef=0.01)


def moe_config(ep=4, **moe_kwargs):
  c = tiny.get_config()
  c.model.n_layers = 4
  c.model.d_ff = 48
  c.model.moe = ml_collections.ConfigDict({**MOE_KWARGS, **moe_kwargs})
  c.data.seq_len = 8
  c.mesh.ep = ep
  return c


def random_params(cfg, seed=0):
  """Model-shaped parameters, every leaf random (norm scales and biases too), drawn on the host."""
  shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  rng = np.random.default_rng(seed)

  def draw(path, s):
    fan_in = s.shape[-2] if len(s.shape) >= 2 else 1
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return np.asarray(1 + 0.2 * rng.standard_normal(s.shape), s.dtype)
    if "expert_bias" in name:
      return np.asarray(0.2 * rng.standard_normal(s.shape), s.dtype)
    if "embed" in name:
      return np.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-1]), s.dtype)
    return np.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def one_device_objective(cfg, params, batch, microbatches=1):
  """(objective, (mean cross-entropy, aux)) with no mesh: every MoE layer on one device.

  The objective is the cross-entropy summed over valid tokens / valid tokens, plus the mean over
  micro-batches (rows j, j+m, ...) of the summed aux losses, each over its micro-batch's tokens.
  """
  m = microbatches
  count = np.sum(batch["mask"])
  ce = aux_loss = 0.0
  for j in range(m):
    total, _, aux = transformer.loss_and_aux(
        cfg, params, batch["tokens"][j::m], batch["targets"][j::m], batch["mask"][j::m]
    )
    ce, aux_loss = ce + total / count, aux_loss + aux["loss"].sum() / m
  return ce + aux_loss, (ce, aux)


def one_device_loss(cfg, params, batch, microbatches=1):
  """(objective, (mean cross-entropy, MoE aux)) of the unsharded model on one device: dense
  models the masked mean cross-entropy, MoE `one_device_objective`."""
  if cfg.moe is not None:
    return one_device_objective(cfg, params, batch, microbatches)
  total, count = transformer.loss(cfg, params, batch["tokens"], batch["targets"], batch["mask"])
  return total / count, (total / count, {})


def assert_one_device(
    cfg, params, batch, loss, grads, microbatches=1, rtol=2e-5, norm_rtol=3e-5
) -> dict:
  """A sharded step's loss and every gradient against `one_device_loss`: the loss within
  relative 1e-5; each gradient element by element within `rtol` of itself plus `rtol` of its
  largest element, and as a whole within `norm_rtol` (the norm of the difference over the norm
  of the one-device gradient). Float32 sums over every token in another order are that far
  from one device's where they cancel: element-wise up to 1.6e-5 (the replicated MoE path and
  tp's shard_map); as a whole up to 2.1e-5 on a K kernel whose one KV head is whole on 4 tp
  ranks (its gradient sums softmax gradients, whose rows sum to zero), 1.7e-5 on the embedding
  at tp 4 with sequence parallelism, 1.2e-5 on an MoE norm scale (a sum over 2 ranks left
  out is off by about 0.5). Returns the one-device MoE aux."""
  (_, (want, aux)), want_grads = jax.jit(
      jax.value_and_grad(
          functools.partial(one_device_loss, cfg, microbatches=microbatches), has_aux=True
      )
  )(params, batch)
  close(loss, want, "loss")
  want_flat = flat(want_grads)
  for path, g in flat(grads).items():
    name, w = jax.tree_util.keystr(path), np.asarray(want_flat[path], np.float64)
    close(g, w, name, rtol=rtol)
    diff = np.linalg.norm(np.asarray(g, np.float64) - w)
    assert diff <= norm_rtol * np.linalg.norm(w), f"{name}: |g - one device| / |one device| = " + (
        f"{diff / np.linalg.norm(w):.2e} > {norm_rtol}"
    )
  return aux


def random_batch(c, seed=0):
  """A host batch of the config's shape: random tokens and targets, about 80% of the mask set."""
  rng = np.random.default_rng(seed)
  b, l, v = c.data.batch, c.data.seq_len, c.model.vocab
  return {
      "tokens": rng.integers(0, v, (b, l)).astype(np.int32),
      "targets": rng.integers(0, v, (b, l)).astype(np.int32),
      "mask": (rng.random((b, l)) > 0.2).astype(np.float32),
  }


def flat(tree) -> dict:
  """{key path: leaf} of a pytree."""
  return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


def assert_refused(overrides: dict, message: str, num_devices: int = 8) -> None:
  """configs/tiny.py with `{'section.field': value}` overrides stops at validation with a
  ConfigError containing `message`."""
  import pytest  # noqa: PLC0415 -- helpers also serve scripts without pytest's fixtures

  from configs import tiny  # noqa: PLC0415
  from jaxpipe.training import config as config_lib  # noqa: PLC0415

  c = tiny.get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    config_lib.validate(c, num_devices)


def close(a, b, what, rtol=1e-5):
  b = np.asarray(b)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-6), err_msg=what)


def path_config(**mesh):
  c = moe_config(ep=2)
  c.model.n_layers, c.model.moe.every, c.pipeline.microbatches = 2, 1, 2
  for axis, size in mesh.items():
    c.mesh[axis] = size
  if mesh.get("pp", 1) > 1:
    c.pipeline.schedule = "zb-h1"
  return c


# --- from training/test_pipeline_lm_moe.py ----------------------------------------


def groups(line: str) -> list[list[int]]:
  """Replica groups of an HLO collective, explicit ({{0,1},...}) or iota ([a,b]<=[dims]T(perm))."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return sorted(sorted(int(i) for i in g.split(",")) for g in re.findall(r"\{([\d,]*)\}", m[1]))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  dims = [int(d) for d in m[3].split(",")]
  ids = np.arange(np.prod(dims)).reshape(dims)
  if m[4]:
    ids = ids.transpose([int(p) for p in m[4].split(",")])
  return sorted(sorted(g) for g in ids.reshape(int(m[1]), int(m[2])).tolist())


def axis_groups(mesh, axis: str) -> list[list[int]]:
  """Logical device ids (positions in the mesh) that differ only in `axis`."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  ids = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
  return sorted(sorted(g) for g in ids.reshape(-1, mesh.shape[axis]).tolist())


# --- from kernels_pallas/test_flash_attention.py ----------------------------------------


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def flash_inputs(batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(kd, (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
  return q, k, v, do


def out_and_grads(fn, q, k, v, do):
  """fn(q, k, v) and its vjp of `do`, as one compiled program."""

  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))

  return jax.jit(run)(q, k, v, do)


# --- from kernels_pallas/test_paged_attention.py ----------------------------------------

KERNEL_PAGE = 4


def paged_inputs(lengths, heads, kv_heads, head_dim=16, page=KERNEL_PAGE, seed=0, window=0):
  """q, pages (NaN wherever no row's keys are), tables (distinct pages, in random order),
  lengths. With a window, a row's keys before its last `window` are NaN too, as pages freed and
  handed to another sequence would be."""
  rng = np.random.default_rng(seed)
  b, n = len(lengths), max(-(-max(lengths) // page), 1)
  num_pages = b * n + 3
  q = rng.standard_normal((b, heads, head_dim)).astype(np.float32)
  k = np.full((kv_heads, num_pages, page, head_dim), np.nan, np.float32)
  v = np.full_like(k, np.nan)
  tables = rng.permutation(num_pages)[: b * n].reshape(b, n).astype(np.int32)
  for row, length in enumerate(lengths):
    pages, slots = tables[row, np.arange(length) // page], np.arange(length) % page
    k[:, pages, slots] = rng.standard_normal((kv_heads, length, head_dim))
    v[:, pages, slots] = rng.standard_normal((kv_heads, length, head_dim))
    gone = np.arange(max(length - window, 0) if window else 0)
    k[:, tables[row, gone // page], gone % page] = np.nan
    v[:, tables[row, gone // page], gone % page] = np.nan
  return q, k, v, tables, np.asarray(lengths, np.int32)


def quantize(x, dtype):
  """Per (head, page, slot) scale: the largest magnitude maps to the dtype's largest value."""
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  x = np.nan_to_num(x)
  scale = np.maximum(np.abs(x).max(-1), 1e-6) / top
  y = x / scale[..., None]
  y = np.round(y) if dtype == jnp.int8 else y
  return jnp.asarray(y).astype(dtype), jnp.asarray(scale, jnp.float32)


# --- from serve/test_engine.py ----------------------------------------

CONTEXT, PAGE = 48, 4  # the engines' context length and page size

DENSE = transformer.TransformerConfig(
    vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64
)  # the compiled kernel's smallest head


MOE = dataclasses.replace(
    DENSE, n_layers=4, moe=MoEConfig(num_experts=4, top_k=2, d_ff=32, every=2)
)


# Gemma's layers (sliding layers between full ones, caps, 1 + w norms, sandwich norms, GeGLU,
# the sliding layers' own rotary base) and Mistral's (every layer slides): windows of 5
GEMMA = dataclasses.replace(
    DENSE,
    n_layers=3,
    sliding_window=5,
    layer_types=("sliding", "full", "sliding"),
    attn_softcap=2.0,
    final_softcap=5.0,
    norm_plus_one=True,
    sandwich_norm=True,
    embed_scale=True,
    activation="gelu_tanh",
    attn_scale_dim=12.0,
    rope_local_theta=100.0,
)
SLIDING = dataclasses.replace(DENSE, sliding_window=5)


# DeepSeek-V3's parts (tests/models/test_deepseek_v3.py holds them equal to transformers'):
# latent attention with a low-rank query and yarn rope, a dense first layer, then MoE layers
# with the sigmoid router, expert groups and a shared expert; a latent of 24 channels
MLA = dataclasses.replace(
    DENSE,
    n_layers=3,
    first_dense=1,
    mla=MLAConfig(
        kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12
    ),
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        d_ff=16,
        router="sigmoid",
        num_shared_experts=1,
        n_groups=2,
        topk_groups=1,
        routed_scaling=2.5,
    ),
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position=16,
        max_position=64,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)


CONFIGS = {
    "dense": DENSE,
    "moe": MOE,
    "gemma": GEMMA,
    "sliding": SLIDING,
    "mla": MLA,
    # with DeepSeek-V3's multi-token prediction module (the MTP drafter's)
    "dense_mtp": dataclasses.replace(DENSE, mtp_depth=1),
    "mla_mtp": dataclasses.replace(MLA, mtp_depth=1),
}


# One compiled step per engine: every step is padded to 16 tokens and the longest block table.
ENGINE_ARGS = dict(
    page_size=PAGE,
    max_batch=4,
    max_tokens_per_step=16,
    max_seq_len=CONTEXT,
    token_buckets=(16,),
    page_buckets=(CONTEXT // PAGE,),
)


@functools.cache
def engine_params(name):
  return random_params(CONFIGS[name], seed=1)


@functools.cache
def forward(name):
  """The training forward pass on [N, CONTEXT] tokens (right-padded: causal, so padding after a
  position does not change its logits)."""
  cfg, params = CONFIGS[name], engine_params(name)
  return jax.jit(lambda tokens: transformer.forward(cfg, params, tokens))


def oracle(name: str, prompts, max_tokens: int) -> list[list[int]]:
  """Greedy generation recomputing every whole sequence at every step."""
  return recompute(name, prompts, max_tokens, lambda i, logits_V, out: int(np.argmax(logits_V)))


def recompute(name: str, prompts, max_tokens: int, pick) -> list[list[int]]:
  """Generation recomputing every whole sequence at every step: token i of a step is
  pick(i, its next-token logits, its output so far); a sequence whose pick is None stops."""
  seqs, outs = [list(p) for p in prompts], [[] for _ in prompts]
  live = [True] * len(seqs)
  for _ in range(max_tokens):
    tokens = np.zeros((len(seqs), CONTEXT), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, : len(s)] = s
    logits = np.asarray(forward(name)(tokens))
    for i, s in enumerate(seqs):
      t = pick(i, logits[i, len(s) - 1], outs[i]) if live[i] else None
      if t is None:
        live[i] = False
        continue
      s.append(t)
      outs[i].append(t)
  return outs


def prompts(seed=0, n=12):
  """n random prompts of 1-30 tokens; with n >= 10, four of them share a prefix."""
  rng = np.random.default_rng(seed)
  prompts = [list(map(int, rng.integers(0, 64, rng.integers(1, 31)))) for _ in range(n)]
  if n < 10:
    return prompts
  shared = list(map(int, rng.integers(0, 64, 9)))
  prompts[2] = shared + [1, 2, 3]  # a 9-token prefix: 2 full pages shared
  prompts[5] = shared + [4]
  prompts[7] = shared[:8]  # exactly 2 pages, all cached: its last token's page is copied
  prompts[9] = shared[:8]
  return prompts


def check_pages(engine):
  """Every page's count is the number of its owners (requests running, parked after prefill or
  reserved for incoming K/V, and the prefix cache); only a sequence's last page has room."""
  owners = np.zeros(engine.num_pages, np.int32)
  for r in engine.running + engine.prefilled + engine.incoming:
    assert len(r.pages) == math.ceil(r.computed / engine.page_size), r.id
    for p in r.pages:
      owners[p] += 1
  for p in (engine.prefix_cache._pages.values() if engine.prefix_cache else ()):
    owners[p] += 1
  np.testing.assert_array_equal(owners, engine.allocator.refs)
  usage = engine.kv_usage()
  assert usage["pages_in_use"] == np.count_nonzero(owners)
  assert usage["slots"] - usage["tokens"] < engine.page_size * max(len(engine.running), 1)


# --- serve/test_scheduler.py, serve/test_router.py: the scheduler on toy pages ---------------


@dataclasses.dataclass(eq=False)
class ToySeq:
  """What `serve.scheduler.Scheduler` needs of a sequence, and a page count."""

  name: str
  length: int
  computed: int = 0
  preemptions: int = 0
  pages: int = 0


def toy_step(plan):
  """What a step does to the sequences it computed: K/V cached, one token sampled by each that
  reached its end."""
  for seq, n in plan:
    seq.computed += n
    if seq.computed == seq.length:
      seq.length += 1


# --- from pipeline/test_api.py ----------------------------------------

B, L, D = 4, 3, 8  # the toy stage's batch, length and width


def stage_fn(params, x_BxLxD):
  return jnp.tanh(x_BxLxD @ params["w"]) + params["b"]


def loss_fn(y_BxLxD, t_BxL):
  # cross-entropy over D classes, summed over tokens
  logp = jax.nn.log_softmax(y_BxLxD, axis=-1)
  return -jnp.sum(jnp.take_along_axis(logp, t_BxL[..., None], axis=-1))


def make_data(num_stages, m, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  params = {
      "w": f32(rng.normal(size=(num_stages, D, D)) / np.sqrt(D)),
      "b": f32(0.1 * rng.normal(size=(num_stages, D))),
  }
  xs = f32(rng.normal(size=(m, B, L, D)))
  ts = jnp.asarray(rng.integers(0, D, size=(m, B, L)), jnp.int32)
  return params, xs, ts


# --- from test_train.py ----------------------------------------


def cli(workdir, *flags):
  return [
      sys.executable,
      "-m",
      "jaxpipe.train",
      "--config",
      "configs/tiny.py",
      "--workdir",
      str(workdir),
      *flags,
  ]


def env(tmp_path, **extra):
  # The runs of one test compile the same programs: share a compilation cache.
  return {
      **os.environ,
      "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
      **extra,
  }


def loss_rows(workdir):
  """(step, loss) of every complete metrics.jsonl line that has a loss, in file order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.endswith("\n")]
  return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def last_logged(workdir):
  try:
    return max((s for s, _ in loss_rows(workdir)), default=0)
  except (FileNotFoundError, ValueError):  # not written yet, or caught mid-rewrite
    return 0


def until_logged(proc, workdir, step, timeout=300, output=None):
  """Waits for `step` in metrics.jsonl; `output()` is what a failure shows (default: the pipes)."""
  deadline = time.time() + timeout
  while last_logged(workdir) < step:
    assert proc.poll() is None, (
        f"the run ended ({proc.returncode}) before step {step}: "
        f"{output()[-5000:] if output else proc.communicate()}"
    )
    assert time.time() < deadline, f"step {step} not reached"
    time.sleep(0.02)


def checkpoint_at(config, workdir, step):
  """A workdir whose run has a checkpoint at `step` (its initial parameters, saved as that step)."""
  with Trainer(config, str(workdir)) as trainer:
    state = trainer.init()
    trainer.checkpointer.save(step, state.replace(step=jnp.asarray(step, jnp.int32)))


# --- a small Llama and its tokenizer, written by transformers (data, serving, end to end) -----

TINY_TEXTS = [
    "def main():\n    return 0\n",
    "import os\nimport sys\n\nprint(os.getcwd())\n",
    "The quick brown fox jumps over the lazy dog. naïve café 東京 🙂",
    "You are a helpful assistant. What is the capital of Japan? Tokyo is the capital.",
    "for i in range(10):\n    print(i * i)\n",
]
TINY_SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's chat template, shape and whitespace; tools (their names, to fit the tiny context)
# and calls as Qwen's (Hermes) template writes them.
TINY_CHAT_TEMPLATE = """{{ bos_token }}
{% if tools %}
  {{ '<|start_header_id|>system<|end_header_id|>\\n\\n<tools>' }}
  {% for tool in tools %}
    {{- tool['function']['name'] + ' ' }}
  {% endfor %}
  {{- '</tools> Call: <tool_call>{"name", "arguments"}</tool_call>' }}
<|eot_id|>
{% endif %}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
  {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
  {{- message['content'] | trim }}
  {% for call in message.get('tool_calls', []) %}
    {{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}
  {% endfor %}
<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
  {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}"""
TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer and Qwen's own tokenizer.json)
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# Llama 3.2's own config fields on TINY_LLAMA's shape: llama3 rotary (factor 32 past 8,192
# positions, as Llama-3.2-1B's config.json), its base, its context; tied embeddings and head_dim
# are TINY_LLAMA's
LLAMA_32 = dict(
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rope_theta=500_000.0,
    max_position_embeddings=131_072,
)


def tiny_bpe(vocab_size: int = 384, qwen: bool = False):
  """A byte-level BPE tokenizer (GPT-2, Llama 3) trained on TINY_TEXTS; BOS added to prompts.

  qwen: laid out as Qwen2's (NFC, its regex split, no BOS, <|endoftext|> among the specials),
  which transformers' Qwen2Tokenizer rebuilds whatever tokenizer.json says."""
  from tokenizers import (
      Regex,
      Tokenizer,
      decoders,
      models,
      normalizers,
      pre_tokenizers,
      processors,
      trainers,
  )

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  if qwen:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=TINY_SPECIALS + (["<|endoftext|>"] if qwen else []),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(TINY_TEXTS * 4, trainer=trainer)
  if not qwen:
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
  return tok


# Every family of jaxpipe.models.families that write_tiny_model writes: (transformers' config
# and model classes, fields beside TINY_LLAMA's). Windows of 5 positions under prompts and
# sequences longer than that; rope variants past a pre-training context of 16 positions.
TINY_FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=5,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=5,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=False,
            sliding_window=5,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=16,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2],
                "long_factor": [2.0, 4.0],
            },
        ),
    ),
}


# DeepSeek-V3 (MoE, so not in TINY_FAMILIES, whose tests are the dense families'): latent
# attention with a low-rank query and yarn rope, one dense first layer then MoE layers with the
# sigmoid router, two expert groups of which each token uses one, and a shared expert
TINY_DEEPSEEK_V3 = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=5,  # one dense, then four MoE layers: one per DualPipeV stage at pp 2
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    q_lora_rank=12,
    kv_lora_rank=20,  # a latent of 24 channels: the CPU kernel's multiple of 8
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
# DeepSeek-V2-Lite's shape: V3's latent attention with a plain query projection, the softmax
# router choosing by score alone (topk_method greedy), two shared experts
TINY_DEEPSEEK_V2 = dict(
    {k: v for k, v in TINY_DEEPSEEK_V3.items() if k not in ("n_group", "topk_group")},
    q_lora_rank=None,
    topk_method="greedy",
    n_shared_experts=2,
    routed_scaling_factor=1.5,
)
MODEL_CLASSES = {  # family -> (config class, model class, fields) of every tiny model
    **{f: (c, m, {**TINY_LLAMA, **own}) for f, (c, m, own) in TINY_FAMILIES.items()},
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", TINY_DEEPSEEK_V3),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", TINY_DEEPSEEK_V2),
}


def write_tiny_llama(path, seed: int = 0, vocab_size: int = 384, **llama_fields) -> str:
  """A random LlamaForCausalLM (`write_tiny_model`) of TINY_LLAMA's shape and `llama_fields`."""
  return write_tiny_model(path, "llama", seed, vocab_size, plain=True, **llama_fields)


def write_deepseek_v3_mtp(root, depth: int) -> tuple[str, str, dict]:
  """A tiny DeepSeek-V3 checkpoint with `depth` MTP modules, as transformers lays them out.

  transformers writes each module's decoder layer in the checkpoint's layout as a layer of a
  deeper model (layers n..n+depth-1); the checkpoint is that file under a config of n layers and
  `num_nextn_predict_layers` depth, with the modules' other tensors added under DeepSeek-V3's
  names (random norms and eh_proj, copies of the embedding and head).

  Args:
    root: a directory for it.
    depth: the MTP modules.

  Returns:
    (the checkpoint's directory, the deeper model's directory, the added tensors by name).
  """
  import torch
  from safetensors.torch import load_file, save_file

  root = pathlib.Path(root)
  n, d = TINY_DEEPSEEK_V3["num_hidden_layers"], TINY_DEEPSEEK_V3["hidden_size"]
  deep = write_tiny_model(root / "deep", "deepseek_v3", num_hidden_layers=n + depth)
  src = root / "src"
  shutil.copytree(deep, src)
  with open(src / "config.json") as f:
    config = json.load(f)
  config.update(num_hidden_layers=n, num_nextn_predict_layers=depth)
  with open(src / "config.json", "w") as f:
    json.dump(config, f, indent=2)
  weights = load_file(src / "model.safetensors")
  gen = torch.Generator().manual_seed(5)
  extra = {}
  for k in range(depth):
    p = f"model.layers.{n + k}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
      extra[p + norm + ".weight"] = 1 + 0.2 * torch.randn(d, generator=gen)
    extra[p + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=gen) / (2 * d) ** 0.5
    extra[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    extra[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
  save_file({**weights, **extra}, src / "model.safetensors", metadata={"format": "pt"})
  return str(src), deep, extra


def write_tiny_model(
    path, family: str, seed: int = 0, vocab_size: int = 384, plain: bool = False, **fields
) -> str:
  """A random model of `family` (MODEL_CLASSES; float32, eager attention) and its BPE tokenizer
  with a chat template, saved by transformers into `path` (config, safetensors, tokenizer files
  and a generation_config whose eos_token_id is [</s>, <|eot_id|>]). Returns the path as a string.

  plain: TINY_LLAMA's fields alone, not the family's own beside them. The weights are unit-scale
  random (not transformers' 0.02 init), so greedy decoding varies from token to token and every
  weight matters; Gemma's (1 + w) norms get w around 0.
  """
  import torch
  import transformers

  path = str(path)
  qwen = family.startswith("qwen")
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tiny_bpe(vocab_size, qwen=qwen),
      bos_token="<s>",
      eos_token="</s>",
      chat_template=TINY_CHAT_TEMPLATE,
  )
  bos, eos = fast.convert_tokens_to_ids("<s>"), fast.convert_tokens_to_ids("</s>")
  eot = fast.convert_tokens_to_ids("<|eot_id|>")
  config_cls, model_cls, own = MODEL_CLASSES[family]
  fields = {**(TINY_LLAMA if plain else own), **fields}
  config = getattr(transformers, config_cls)(
      vocab_size=vocab_size,
      bos_token_id=bos,
      eos_token_id=eos,
      pad_token_id=None,
      attn_implementation="eager",
      **fields,
  )
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config)
  gen = torch.Generator().manual_seed(seed)
  plus_one = family.startswith("gemma")
  # DeepSeek-V3's five layers of experts amplify float32 rounding to 1e-4 of the gradients at
  # twice the unit-variance weights (transformers' own float32 run against its float64 one)
  scale = 1.0 if family.startswith("deepseek") else 2.0
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(0.2 * noise if plus_one else 1 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.5 * noise)
      else:
        p.copy_(scale * noise / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # DeepSeek's router: changes the choice
        b.copy_(0.5 * torch.randn(b.shape, generator=gen))
  model.generation_config = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot])
  model.save_pretrained(path)
  fast.save_pretrained(path)
  return path


# --- from serve/http/test_app.py and test_llama.py ----------------------------------------


def wait_healthy(url, alive, timeout=300.0, output=lambda: "") -> None:
  """Waits until a server's /health answers 200.

  Args:
    url: the server's base URL.
    alive: whether the server still runs (a thread's or a process' check).
    timeout: seconds to wait at most.
    output: what the server printed, for the message when it died.
  """
  import httpx

  deadline = time.monotonic() + timeout
  while True:
    assert alive(), f"the server at {url} died while starting: {output()}"
    assert time.monotonic() < deadline, f"{url} did not become healthy in {timeout:.0f} s"
    try:
      if httpx.get(url + "/health").status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(0.2)


def metrics(url) -> dict[tuple, float]:
  """Every sample of a server's /metrics as {(name, labels...): value}, through Prometheus' own
  parser."""
  import httpx
  from prometheus_client.parser import text_string_to_metric_families

  out = {}
  for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
    for s in family.samples:
      out[(s.name, *sorted(s.labels.items()))] = s.value
  return out


# --- from serve/test_engine.py and test_ragged.py ----------------------------------------


def serve_arrivals(engine, prompts, max_tokens, arrive_every=3, per_arrival=2, first=4, **kwargs):
  """Adds `first` requests, then `per_arrival` more every `arrive_every` steps, until all finish.

  kwargs go to add_request; a list value gives each request its own.
  """
  ids, queue, step = [], list(enumerate(prompts)), 0
  while queue or engine.has_work():
    if queue and step % arrive_every == 0:
      k = per_arrival if ids else first
      for i, p in queue[:k]:
        ids.append(
            engine.add_request(
                p,
                max_tokens,
                **{key: v[i] if isinstance(v, list) else v for key, v in kwargs.items()},
            )
        )
      queue = queue[k:]
    engine.step()
    check_pages(engine)
    step += 1
  done = {r.id: r for r in engine.finished()}
  return [done[i] for i in ids]


# --- from serve/test_ragged.py ------------------------------------------------------------------


def ragged_pages(seqs, page_size, kv_heads, head_dim, rng, rows=None, tokens=None, window=0):
  """Random pools holding the sequences' keys (NaN in every other slot) and the step's rows:
  seqs are (tokens cached before the step, tokens in the step); each gets its own pages, in a
  shuffled order. -> (k, v, RaggedRows, per-token tables, per-token lengths, live tokens).
  With a window, the keys no token of the step sees (the first's before its window) are NaN
  too, as pages freed and handed to another sequence would be."""
  from jaxpipe.ops.attention import RaggedRows

  s = page_size
  need = [-(-(c + n) // s) for c, n in seqs]
  n_max, total = max(need), sum(need) + 3  # three pages no row owns
  k = np.full((kv_heads, total, s, head_dim), np.nan, np.float32)
  v = np.full_like(k, np.nan)
  order = rng.permutation(total)
  rows = rows or len(seqs)
  tables = np.zeros((rows, n_max), np.int32)
  starts, counts, cached = (np.zeros(rows, np.int32) for _ in range(3))
  tokens = tokens or sum(n for _, n in seqs)
  tables_T, lengths_T = np.zeros((tokens, n_max), np.int32), np.ones(tokens, np.int32)
  at = used = 0
  for i, ((c, n), m) in enumerate(zip(seqs, need)):
    pages = order[used : used + m]
    used += m
    for pos in range(c + n):
      k[:, pages[pos // s], pos % s] = rng.standard_normal((kv_heads, head_dim))
      v[:, pages[pos // s], pos % s] = rng.standard_normal((kv_heads, head_dim))
    if window:
      gone = np.arange(max(c - window + 1, 0))
      k[:, pages[gone // s], gone % s] = np.nan
      v[:, pages[gone // s], gone % s] = np.nan
    tables[i, :m] = pages
    starts[i], counts[i], cached[i] = at, n, c
    tables_T[at : at + n] = tables[i]
    lengths_T[at : at + n] = np.arange(c, c + n) + 1
    at += n
  return k, v, RaggedRows(tables, starts, counts, cached), tables_T, lengths_T, at


def ragged_case():
  """One step of five sequences in a flat batch of 40 tokens (pages of 4; 2 KV heads, 6 query
  heads, head dim 16), three padding rows and padding tokens at the end, NaN in every slot no
  row owns: (q, k pages, v pages, rows, per-token tables, per-token lengths, live tokens)."""
  from jaxpipe.ops.attention import RaggedRows

  s, g, h, d = 4, 2, 6, 16  # page size, KV heads, query heads (GQA: 3 per KV head), head dim
  t, b, n = 40, 8, 6  # step tokens (padded), rows (padded), pages per block table
  # (pages, tokens cached before the step, tokens in the step)
  seqs = [
      ([3, 9], 0, 7),  # a first chunk ending mid-page
      ([1, 4, 12], 9, 1),  # a decode row
      ([5, 7, 2], 5, 6),  # a later chunk over a cached prefix, ending mid-page
      ([5, 7, 11, 13], 8, 7),  # a prefix-cache hit: pages 5 and 7 shared with the row above
      ([6, 14], 4, 1),  # a decode row at a page's first slot
  ]
  rng = np.random.default_rng(0)
  k_pages = np.full((g, 16, s, d), np.nan, np.float32)
  v_pages = np.full((g, 16, s, d), np.nan, np.float32)
  tables_TxN, lengths_T = np.zeros((t, n), np.int32), np.ones(t, np.int32)
  tables_BxN = rng.integers(0, 16, (b, n)).astype(np.int32)  # padding rows: any pages
  starts, counts, cached = (np.zeros(b, np.int32) for _ in range(3))
  at = 0
  for i, (pages, done, count) in enumerate(seqs):
    for pos in range(done + count):  # every slot the sequence holds is written (shared: twice)
      page, slot = pages[pos // s], pos % s
      if np.isnan(k_pages[0, page, slot, 0]) or pos >= done:
        k_pages[:, page, slot] = rng.standard_normal((g, d))
        v_pages[:, page, slot] = rng.standard_normal((g, d))
    tables_BxN[i] = 0
    tables_BxN[i, : len(pages)] = pages
    starts[i], counts[i], cached[i] = at, count, done
    tables_TxN[at : at + count] = tables_BxN[i]
    lengths_T[at : at + count] = np.arange(done, done + count) + 1
    at += count
  q = rng.standard_normal((t, h, d)).astype(np.float32)
  rows = RaggedRows(tables_BxN, starts, counts, cached)
  return q, k_pages, v_pages, rows, tables_TxN, lengths_T, at


def ragged_engine(attention: str, devices: int = 1, name: str = "dense", **kw):
  """An engine of model `name` with a small pool (preemption happens) whose freed pages are NaN,
  on `attention`, over `devices` devices; `kw`: further `EngineConfig` fields."""
  from jaxpipe.serve import Engine

  engine = Engine(
      CONFIGS[name],
      engine_params(name),
      num_pages=17,
      nan_freed_pages=True,
      attention=attention,
      devices=jax.devices()[:devices],
      **ENGINE_ARGS,
      **kw,
  )
  assert engine.backend == attention
  return engine


# --- from models/test_families.py and test_deepseek_v3.py --------------------------------


def hf_oracle(model, ids, grad_dir):
  """transformers' (loss, logits, gradients by checkpoint name) for labels = ids; the gradients
  saved by save_pretrained as if they were weights, so that transformers lays them out."""
  import copy

  import torch
  from safetensors.numpy import load_file

  model.zero_grad()
  out = model(input_ids=torch.tensor(ids), labels=torch.tensor(ids))
  out.loss.backward()
  grads = copy.deepcopy(model)
  with torch.no_grad():
    for p, g in zip(model.parameters(), grads.parameters()):
      g.copy_(p.grad)
  grads.save_pretrained(grad_dir)
  return out.loss.item(), out.logits.detach().numpy(), load_file(f"{grad_dir}/model.safetensors")


def load_hf_model(directory):
  """transformers' model of a checkpoint directory, eager attention and experts, in eval mode."""
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, attn_implementation="eager", experts_implementation="eager"
  )
  return model.eval()


def check_against_transformers(cfg, params, model, ids, tmp, model_type, frozen=None):
  """jaxpipe's logits, loss and every gradient against transformers' `model` on token rows
  `ids`, at the dense families' tolerances (tests/models/test_families.py); tensors whose name
  ends in `frozen` (a buffer there, such as DeepSeek-V3's choice bias) get a zero gradient."""
  from jaxpipe.models import hf, transformer

  batch = lm_batch(ids)

  def objective(params):
    total, count, _ = transformer.loss_and_aux(
        cfg, params, batch["tokens"], batch["targets"], batch["mask"]
    )
    return total / count, transformer.forward(cfg, params, batch["tokens"])

  (loss, logits), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  want_loss, want_logits, want_grads = hf_oracle(model, ids, str(tmp))
  assert rel_f64(logits, want_logits) < 1e-5
  assert abs(float(loss) - want_loss) < 1e-5 * want_loss
  got = dict(hf.hf_tensors(cfg, grads, model_type))
  assert got.keys() == want_grads.keys()
  for name, g in want_grads.items():
    if frozen and name.endswith(frozen):
      assert not np.any(got[name]), name
    else:
      assert rel_f64(got[name], g) < 2e-5, name


def lm_batch(ids):
  """The batch of token rows `ids` as transformers' labels=ids counts them."""
  mask = np.ones(ids.shape, np.float32)
  mask[:, -1] = 0.0  # transformers shifts the labels
  return dict(
      tokens=ids.astype(np.int32), targets=np.roll(ids, -1, axis=1).astype(np.int32), mask=mask
  )


def rel_f64(a, b):
  """The largest difference relative to b's largest magnitude, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
  """Tokens generated before each request's first divergence from `want`, over all."""
  same = 0
  for g, w in zip(got, want):
    same += next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
  return same / sum(map(len, want))


def check_round_trip(src: str, dst: str):
  """Imports `src` (a checkpoint transformers wrote), exports it into `dst` and checks the two
  bit for bit: the same tensors in the same dtypes and bytes, the same config.json, the same
  model read back. Returns the model's config."""
  from jaxpipe.models import hf

  plan = hf.check(src)
  cfg, params = hf.load(plan)
  written = hf.save(cfg, params, dst, hf_config=plan.hf_config)
  same_weights(src, dst)
  with open(os.path.join(src, hf.CONFIG_FILE)) as f:
    assert json.load(f) == written
  assert hf.check(dst).cfg == cfg
  return cfg


def same_weights(src: str, dst: str) -> None:
  """The two checkpoint directories hold the same tensors, dtypes and bytes (one file each)."""
  from safetensors.numpy import load_file

  from jaxpipe.models import hf

  want, got = (load_file(os.path.join(d, hf.WEIGHTS_FILE)) for d in (src, dst))
  assert want.keys() == got.keys()
  for name in want:
    assert want[name].dtype == got[name].dtype and want[name].tobytes() == got[name].tobytes(), name


def run_deployments(deployments, prompts, max_tokens: int) -> list[list]:
  """Each deployment's finished requests for `prompts` (greedy, no EOS), in prompt order, the
  pages of every engine checked after every step (`check_pages`)."""
  results = []
  for dep in deployments:
    ids = [dep.add_request(p, max_tokens, eos_id=None) for p in prompts]
    while dep.has_work():
      dep.step()
      for e in dep.engines:
        check_pages(e)
    done = {r.id: r for r in dep.finished()}
    results.append([done[i] for i in ids])
  return results
