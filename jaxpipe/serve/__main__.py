"""Generate text from a trained model, or serve it over HTTP (OpenAI's completions API).

  python -m jaxpipe.serve --workdir /tmp/qs --prompt "def " --max_tokens 64
  python -m jaxpipe.serve --config configs/quickstart.py --prompt "import " --temperature 0.8
      [--prompt ...] [--top_k K] [--top_p P] [--seed S] [--max_seq_len N] [--num_pages N]
      [--dtype float32|bfloat16] [--kv_cache_dtype auto|int8|fp8] [--tensor_parallel N]
  python -m jaxpipe.serve --workdir /tmp/qs --http --host 127.0.0.1 --port 8000
      [--max_batch 16] [--max_queue 64] [--drain_s 30] [--token_buckets 8,32,256]
      [--page_buckets 16]
      [--mode disaggregated --prefill_workers 1 --decode_workers 2 --devices_per_worker 1]
  python -m jaxpipe.serve --workdir /tmp/qs --role prefill|decode|replica --port 8001
      [--transfer_address 127.0.0.1:0] [--fleet_secret S] [--offer_timeout_s 30]
  python -m jaxpipe.serve --workdir /tmp/qs --role router --port 8000
      --prefill_urls http://127.0.0.1:8001 --decode_urls http://127.0.0.1:8002
      [--replica_urls URL,URL] [--routing cache_aware|least_loaded] [--fleet_secret S]

--workdir serves the newest checkpoint of a `python -m jaxpipe.train` run (its config.json
gives the model) or of a checkpoint converted by `python -m jaxpipe.convert hf-to-orbax`;
--config serves the fresh parameters of a config file. Text goes through the model's tokenizer
(`jaxpipe.models.tokenizer.for_workdir`: WORKDIR/hf's for a converted checkpoint, whose EOS ids
end generation, else UTF-8 bytes, one token each); several --prompt flags are served as one
continuously batched workload. The context served is the model's max_position_embeddings for a
converted checkpoint, data.seq_len for jaxpipe's own, unless --max_seq_len says otherwise.
--http serves POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize, GET /v1/models,
/version, /health and /metrics (jaxpipe/serve/http/) until SIGTERM, after which running requests
get --drain_s seconds to finish before they are cancelled; every step program is compiled first.
--mode colocated|disaggregated serves a deployment of several engines (jaxpipe/serve/deploy.py)
behind the same endpoint, each worker with the engine flags; the default is one engine.
--role serves past one process (jaxpipe/serve/fleet/): a prefill, decode or replica server
takes token ids from a router over HTTP (its /fleet/ routes need --fleet_secret when one is
set), and K/V pages move from prefill to decode servers over JAX's transfer server at
--transfer_address; the router serves the OpenAI API above them (--api_key, --max_queue and
--drain_s as --http) and needs the model's config and tokenizer, not its weights.
Started by `python -m jaxpipe.launch --processes N -- python -m jaxpipe.serve ... --tensor_parallel
D` (D: every process's devices), one engine spans the processes (jaxpipe/serve/lockstep.py):
process 0 serves --http (or prints --prompt's text) and the others replay its engine's calls.
"""

import collections
import dataclasses
import json
import os
import sys
import time

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxpipe.models import tokenizer as tokenizer_lib  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)  # absl's FLAGS when run, else its own (`jaxpipe.runtime.cli`)

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "ml_collections config file (get_config); serves fresh parameters.",
    lock_config=True,
    flag_values=FLAGS,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "A training run's workdir: serve its newest checkpoint.", flag_values=FLAGS
)
_PROMPT = flags.DEFINE_multi_string(
    "prompt", [], "Prompt text (encoded by the model's tokenizer).", flag_values=FLAGS
)
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", 64, "Tokens to generate per prompt.", flag_values=FLAGS
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.", flag_values=FLAGS)
_TOP_K = flags.DEFINE_integer(
    "top_k", 0, "Sample among the k most likely tokens; 0 = all.", flag_values=FLAGS
)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1 = all.", flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "Prompt i samples with seed + i.", flag_values=FLAGS)
_MAX_SEQ_LEN = flags.DEFINE_integer(
    "max_seq_len",
    None,
    "Context served (prompt + generated); default the model's max_position_embeddings "
    "(a converted checkpoint) or data.seq_len (the length a jaxpipe model was trained on).",
    flag_values=FLAGS,
)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
_NUM_PAGES = flags.DEFINE_integer(
    "num_pages", 256, "KV pages per layer (page 0 is scratch).", flag_values=FLAGS
)
_DTYPE = flags.DEFINE_enum(
    "dtype",
    None,
    ["float32", "bfloat16"],
    "The weights' and the compute's dtype (default: the run's model.dtype): bfloat16 halves the "
    "weights (cast once, at load) and, with --kv_cache_dtype auto, the KV pages.",
    flag_values=FLAGS,
)
_KV_CACHE_DTYPE = flags.DEFINE_enum(
    "kv_cache_dtype",
    "auto",
    ["auto", "int8", "fp8"],
    "KV pages' dtype: auto (the compute dtype), int8 or fp8 (quantized, a scale per slot).",
    flag_values=FLAGS,
)
_SPECULATIVE = flags.DEFINE_enum(
    "speculative",
    None,
    ["ngram", "draft", "mtp"],
    "Speculative decoding: ngram (drafts from the request's own tokens: prompt lookup), draft "
    "(a smaller model's greedy tokens: --draft_workdir) or mtp (the model's own multi-token "
    "prediction module: DeepSeek-V3's), each step verifying up to --num_speculative_tokens "
    "drafts per request; turns async scheduling off.",
    flag_values=FLAGS,
)
_DRAFT_WORKDIR = flags.DEFINE_string(
    "draft_workdir",
    None,
    "--speculative draft: the draft model's workdir (a training run or converted checkpoint "
    "with the served model's tokenizer); it gets the served engine's page and batch settings.",
    flag_values=FLAGS,
)
_NUM_SPECULATIVE_TOKENS = flags.DEFINE_integer(
    "num_speculative_tokens", 4, "--speculative: drafts per request per step.", flag_values=FLAGS
)
_NGRAM_MAX = flags.DEFINE_integer(
    "ngram_max", 4, "--speculative ngram: the longest suffix matched.", flag_values=FLAGS
)
_ATTENTION = flags.DEFINE_string(
    "attention",
    "auto",
    "Paged attention: xla, pallas, xla_ragged, pallas_ragged, cpu_ragged, auto (pallas on "
    "GPU; cpu_ragged on CPU where the C++ kernel builds, for a float32, bfloat16 or int8 "
    "cache; else xla_ragged)",
    flag_values=FLAGS,
)
_MATMUL = flags.DEFINE_enum(
    "matmul",
    "auto",
    ["auto", "onednn", "xla"],
    "The GEMM of the projections and the output head: onednn (oneDNN's, CPU only), xla (XLA's "
    "dot), auto (onednn on a CPU where it builds; else xla)",
    flag_values=FLAGS,
)
_MAX_BATCH = flags.DEFINE_integer(
    "max_batch",
    None,
    "Most sequences running at once; default 16 (--http) or the number of prompts, at most 16.",
    flag_values=FLAGS,
)
_MAX_TOKENS_PER_STEP = flags.DEFINE_integer(
    "max_tokens_per_step", 256, "Token budget of a step.", flag_values=FLAGS
)
_TOKEN_BUCKETS = flags.DEFINE_list(
    "token_buckets",
    None,
    "Padded step sizes in tokens; default powers of two from 8 and, from 64 on, 1.5 times "
    "each (96, 192, ...), up to --max_tokens_per_step.",
    flag_values=FLAGS,
)
_PAGE_BUCKETS = flags.DEFINE_list(
    "page_buckets",
    None,
    "Padded pages per sequence; default the whole context alone.",
    flag_values=FLAGS,
)
_POOL_HOST_MEMORY = flags.DEFINE_bool(
    "pool_host_memory",
    True,
    "On CPU devices keep freed host memory in the heap (glibc mallopt), so that no step faults "
    "its temporaries in again; --nopool_host_memory: glibc's defaults.",
    flag_values=FLAGS,
)
_HTTP = flags.DEFINE_bool(
    "http", False, "Serve over HTTP instead of generating from --prompt.", flag_values=FLAGS
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "--http: address to listen on.", flag_values=FLAGS)
_PORT = flags.DEFINE_integer("port", 8000, "--http: port to listen on.", flag_values=FLAGS)
_MAX_QUEUE = flags.DEFINE_integer(
    "max_queue",
    64,
    "--http: sequences waiting beyond --max_batch before requests are answered 429.",
    flag_values=FLAGS,
)
_DRAIN_S = flags.DEFINE_float(
    "drain_s",
    30.0,
    "--http: seconds running requests may go on after SIGTERM before they are cancelled.",
    flag_values=FLAGS,
)
_MODE = flags.DEFINE_enum(
    "mode",
    "engine",
    ["engine", "colocated", "disaggregated"],
    "--http: one engine, or a deployment of workers (serve/deploy.py).",
    flag_values=FLAGS,
)
_WORKERS = flags.DEFINE_integer("workers", 2, "--mode colocated: workers.", flag_values=FLAGS)
_PREFILL_WORKERS = flags.DEFINE_integer(
    "prefill_workers", 1, "--mode disaggregated: prefill workers.", flag_values=FLAGS
)
_DECODE_WORKERS = flags.DEFINE_integer(
    "decode_workers", 1, "--mode disaggregated: decode workers.", flag_values=FLAGS
)
_TENSOR_PARALLEL = flags.DEFINE_integer(
    "tensor_parallel",
    1,
    "Devices the engine splits the model over, Megatron's tensor parallelism (heads, KV heads "
    "with their pages, d_ff and the vocabulary); --mode: use --devices_per_worker.",
    flag_values=FLAGS,
)
_DEVICES_PER_WORKER = flags.DEFINE_integer(
    "devices_per_worker",
    1,
    "--mode: devices of each worker, over which it runs tensor-parallel.",
    flag_values=FLAGS,
)
_MODEL_NAME = flags.DEFINE_string(
    "model_name",
    None,
    "--http: the served model's name; default the workdir's or config file's name.",
    flag_values=FLAGS,
)
_API_KEY = flags.DEFINE_string(
    "api_key",
    None,
    "--http: the Bearer token every request but /health, /ready, /metrics and /version must carry "
    "(vLLM's --api-key); default: $JAXPIPE_API_KEY, else none (anyone may call).",
    flag_values=FLAGS,
)
_ROLE = flags.DEFINE_enum(
    "role",
    "engine",
    ["engine", "prefill", "decode", "replica", "router"],
    "engine: one process serves (--http or --prompt); prefill, decode, replica: a server of a "
    "fleet, behind a --role router (jaxpipe/serve/fleet/).",
    flag_values=FLAGS,
)
_PREFILL_URLS = flags.DEFINE_list(
    "prefill_urls", [], "--role router: the prefill servers' URLs.", flag_values=FLAGS
)
_DECODE_URLS = flags.DEFINE_list(
    "decode_urls", [], "--role router: the decode servers' URLs.", flag_values=FLAGS
)
_REPLICA_URLS = flags.DEFINE_list(
    "replica_urls",
    [],
    "--role router: colocated servers' URLs (--role replica), instead of prefill and decode.",
    flag_values=FLAGS,
)
_ROUTING = flags.DEFINE_enum(
    "routing",
    "cache_aware",
    ["cache_aware", "least_loaded"],
    "--role router: cache_aware (SGLang's: the server with the longest cached prefix unless the "
    "loads are uneven) or least_loaded (by KV pages in flight).",
    flag_values=FLAGS,
)
_CACHE_THRESHOLD = flags.DEFINE_float(
    "cache_threshold",
    0.5,
    "--routing cache_aware: route by prefix when it covers at least this share of the prompt.",
    flag_values=FLAGS,
)
_BALANCE_ABS = flags.DEFINE_integer(
    "balance_abs_threshold",
    32,
    "--routing cache_aware: loads (KV pages) this far apart, and --balance_rel_threshold times "
    "apart, are uneven: the least-loaded server takes the request.",
    flag_values=FLAGS,
)
_BALANCE_REL = flags.DEFINE_float(
    "balance_rel_threshold", 1.5, "See --balance_abs_threshold.", flag_values=FLAGS
)
_FLEET_SECRET = flags.DEFINE_string(
    "fleet_secret",
    None,
    "--role: the Bearer token of calls between a fleet's servers (every /fleet/ route); default: "
    "$JAXPIPE_FLEET_SECRET, else none (anyone who reaches a server may call it).",
    flag_values=FLAGS,
)
_TRANSFER_ADDRESS = flags.DEFINE_string(
    "transfer_address",
    "127.0.0.1:0",
    "--role prefill|decode: where the K/V transfer server listens (host:port, 0: any port). It "
    "has no authentication of its own: name an address only the fleet's network reaches.",
    flag_values=FLAGS,
)
_OFFER_TIMEOUT_S = flags.DEFINE_float(
    "offer_timeout_s",
    30.0,
    "--role prefill: seconds a request's K/V pages wait to be pulled before they are freed.",
    flag_values=FLAGS,
)
_PULL_TIMEOUT_S = flags.DEFINE_float(
    "pull_timeout_s",
    30.0,
    "--role decode: seconds a ticket may wait for a batch slot and pages and be pulled.",
    flag_values=FLAGS,
)
_TOOL_CALL_PARSER = flags.DEFINE_enum(
    "tool_call_parser",
    None,
    ["hermes", "llama3_json", "mistral"],
    "--http: the format of the model's tool calls (vLLM's names); default: the one its chat "
    "template writes (<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: llama3_json).",
    flag_values=FLAGS,
)


def _ints(name: str, values: list[str] | None) -> list[int] | None:
  try:
    return None if values is None else [int(v) for v in values]
  except ValueError:
    raise app.UsageError(
        f"--{name}={','.join(values)} must be a comma-separated list of integers"
    ) from None


def main(argv: list[str]) -> None:
  """Runs the command (module docstring): generates from --prompt, or serves over --http.

  Args:
    argv: the program name (any other positional argument is a usage error).

  Raises:
    app.UsageError: not exactly one of --workdir and --config, not exactly one of --prompt and
      --http, --mode other than engine without --http, or --tensor_parallel with such a mode.
  """
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (_CONFIG.value is None) == (_WORKDIR.value is None):
    raise app.UsageError(
        "give exactly one of --workdir (a training run) or --config (fresh parameters)"
    )
  fleet = _ROLE.value != "engine"
  if fleet and (_PROMPT.value or _MODE.value != "engine"):
    raise app.UsageError(f"--role={_ROLE.value} serves over HTTP alone: drop --prompt and --mode")
  if not fleet and _HTTP.value == bool(_PROMPT.value):
    raise app.UsageError('give --prompt (e.g. --prompt "def ") or --http, not both')
  if _MODE.value != "engine" and not _HTTP.value:
    raise app.UsageError(f"--mode={_MODE.value} serves over HTTP only; add --http")
  if _MODE.value != "engine" and _TENSOR_PARALLEL.value != 1:
    raise app.UsageError(
        f"--tensor_parallel is one engine's; with --mode={_MODE.value} give each worker its "
        "devices with --devices_per_worker"
    )
  token_buckets = _ints("token_buckets", _TOKEN_BUCKETS.value)
  page_buckets = _ints("page_buckets", _PAGE_BUCKETS.value)
  logging.set_verbosity(logging.WARNING)
  try:  # a multi-process run (python -m jaxpipe.launch): one engine over every process's devices
    multi = process.initialize()
  except ValueError as e:
    sys.exit(f"error: {e}")
  if multi and (fleet or _MODE.value != "engine"):
    sys.exit(
        "error: over several processes the engine serves alone (--http or --prompt); --role "
        "and --mode run one process per server or worker"
    )
  import jax

  pooled = _POOL_HOST_MEMORY.value and jax.default_backend() == "cpu"
  if pooled:
    # glibc unmaps freed blocks over 32 MB and maps them again at the next step: at
    # Llama-3.2-1B's shape in bfloat16 decode steps ran 5% faster pooled (docs/serving.md)
    process.pool_host_memory()

  from jaxpipe.ops import matmul as matmul_lib
  from jaxpipe.serve.engine import Engine
  from jaxpipe.serve.speculative import SpecConfig
  from jaxpipe.training import config as config_lib
  from jaxpipe.training import restore

  if _WORKDIR.value:
    try:
      config = restore.run_config(_WORKDIR.value)
    except (FileNotFoundError, RuntimeError) as e:
      sys.exit(f"error: {e}")
  else:
    config = _CONFIG.value
  cfg = config_lib.model_config(config)
  tok = _tokenizer(cfg)  # refused before any device work
  if _ROLE.value == "router":  # the model's config and tokenizer; its servers hold the weights
    _serve_router(cfg, tok)
    return
  if _WORKDIR.value:
    try:
      step, params = restore.restore_params(_WORKDIR.value, config, dtype=_DTYPE.value)
    except (FileNotFoundError, RuntimeError) as e:
      sys.exit(f"error: {e}")
    source = f"step {step} of {_WORKDIR.value}"
  else:
    source = f"fresh parameters of {config_flags.get_config_filename(FLAGS['config'])}"
    params = restore.fresh_params(config)
  if _DTYPE.value is not None:
    cfg, params = in_dtype(cfg, params, _DTYPE.value)
  max_seq_len = _MAX_SEQ_LEN.value or _model_context(_WORKDIR.value) or config.data.seq_len
  pool = (_NUM_PAGES.value - 1) * _PAGE_SIZE.value  # tokens the KV pool holds (page 0: scratch)
  if _MAX_SEQ_LEN.value is None and max_seq_len > pool:
    # A model's max_position_embeddings (131,072 for Llama 3) is far more than the default pool:
    # serve what one sequence can hold, as vLLM caps max_model_len by its KV cache.
    print(
        f"# the context is capped at {pool} tokens, what --num_pages {_NUM_PAGES.value} of "
        f"--page_size {_PAGE_SIZE.value} hold (the model's is {max_seq_len}); give more pages "
        "for more",
        flush=True,
    )
    max_seq_len = pool
  max_batch = _MAX_BATCH.value or (16 if _HTTP.value or fleet else min(16, len(_PROMPT.value)))
  # One page bucket (the whole context) by default: one program per token bucket.
  kw = dict(
      page_size=_PAGE_SIZE.value,
      num_pages=_NUM_PAGES.value,
      max_batch=max_batch,
      max_tokens_per_step=_MAX_TOKENS_PER_STEP.value,
      max_seq_len=max_seq_len,
      token_buckets=token_buckets,
      page_buckets=page_buckets or (-(-max_seq_len // _PAGE_SIZE.value),),
      attention=_ATTENTION.value,
      matmul=_MATMUL.value,
      eos_id=tok.eos_ids or None,
  )
  if _KV_CACHE_DTYPE.value != "auto":
    kw["kv_cache_dtype"] = _KV_CACHE_DTYPE.value
  try:
    if _SPECULATIVE.value:
      kw["speculative"] = SpecConfig(
          _SPECULATIVE.value,
          _NUM_SPECULATIVE_TOKENS.value,
          _NGRAM_MAX.value,
          min(2, _NGRAM_MAX.value),
          _drafter(cfg, kw) if _SPECULATIVE.value == "draft" else None,
      )
    if _ROLE.value == "prefill":
      kw["prefill_only"] = True
    elif _ROLE.value == "decode":
      kw["prefix_caching"] = False  # it takes whole requests, never prompts
    if _MODE.value == "engine":
      engine = Engine(cfg, params, devices=_engine_devices(_TENSOR_PARALLEL.value), **kw)
    else:
      engine = _deployment(cfg, params, kw)
  except ValueError as e:
    sys.exit(f"error: {e}")
  del params  # each engine holds its own (on CPU, each layer's weights unstacked: a copy)
  if note := matmul_lib.bfloat16_note(matmul_lib.resolve(_MATMUL.value), cfg.compute_dtype):
    print(note, flush=True)
  if pooled:  # what the load freed (a float32 checkpoint served in bfloat16) back to the OS
    process.trim_host_memory()
  if fleet:
    _serve_worker(engine, source)
    return
  if _HTTP.value:
    if multi:
      engine = _lockstep(engine)
      if engine is None:  # a follower: it replayed process 0's calls until it stopped
        return
    _serve_http(engine, cfg, source, tok)
    if multi:
      engine.close()
    return
  if multi and jax.process_index():  # every process generates the same; process 0 prints
    engine.generate([tok.encode(p) for p in _PROMPT.value], max_tokens=_MAX_TOKENS.value)
    return
  try:
    prompts = [tok.encode(p) for p in _PROMPT.value]
    outputs = engine.generate(
        prompts,
        max_tokens=_MAX_TOKENS.value,
        temperature=_TEMPERATURE.value,
        seed=_SEED.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  print(
      f"# {source}; {jax.devices()[0].platform}"
      f"{f' x {engine.mesh.size} tensor-parallel' if engine.mesh.size > 1 else ''}, "
      f"paged attention {engine.backend}, matmul {engine.matmul}, "
      f"{len(engine.programs)} compiled step programs, {engine.steps} steps"
      + (f"; {engine.rings_note()}" if engine.ring_size else "")
  )
  if engine.speculative is not None:
    drafts, kept = engine.counts["spec_drafts"], engine.counts["spec_accepted"]
    print(f"# speculative: {kept} of {drafts} drafts accepted ({kept / max(drafts, 1):.0%})")
  for prompt, out in zip(_PROMPT.value, outputs):
    print(prompt + tok.decode([t for t in out if t not in tok.eos_ids]))
    print(f"# tokens: {out}")


def in_dtype(cfg, params, dtype: str):
  """(cfg computing in `dtype`, params cast to it): the weights held as they are multiplied.

  Args:
    cfg: the model's `TransformerConfig`.
    params: its params; floating-point leaves are cast, others kept.
    dtype: the compute dtype, e.g. 'bfloat16'.

  Returns:
    (the config with `dtype`, the cast params).
  """
  import jax
  import jax.numpy as jnp

  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  # (a leaf already in `dtype`, as `restore.restore_params(dtype=)` reads them, is kept as is)
  return dataclasses.replace(cfg, dtype=dtype), jax.tree.map(cast, params)


def _spans(engine) -> str:
  """' x N tensor-parallel' (and ' over P processes') for an engine over several devices."""
  import jax

  n = engine.mesh.size
  over = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
  return f" x {n} tensor-parallel{over}" if n > 1 else ""


def _lockstep(engine):
  """A multi-process run: process 0's engine as a `lockstep.Leader`; None on the others, once
  they have followed it to its end (they leave SIGTERM to process 0, which drains and stops
  them)."""
  import signal

  import jax

  from jaxpipe.serve import lockstep

  if jax.process_index():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  return lockstep.connect(engine)


def _engine_devices(n: int) -> list:
  """The first n devices; exits with one line when there are fewer, or, over several
  processes, when they are not all of them (every process must hold a part of the engine)."""
  import jax

  devices = jax.devices()
  if jax.process_count() > 1 and n != len(devices):
    sys.exit(
        f"error: --tensor_parallel={n}: over {jax.process_count()} processes the engine spans "
        f"every device of every process; give --tensor_parallel={len(devices)}"
    )
  if not 1 <= n <= len(devices):
    sys.exit(
        f"error: --tensor_parallel={n} needs 1 to {len(devices)} devices (this process has "
        f"{len(devices)}; on CPU set JAXPIPE_HOST_DEVICES)"
    )
  return devices[:n]


def _tokenizer(cfg):
  """The workdir's tokenizer (bytes for jaxpipe's own models), checked against the embedding."""
  try:
    tok = tokenizer_lib.for_workdir(_WORKDIR.value) if _WORKDIR.value else None
    if tok is None or isinstance(tok, tokenizer_lib.ByteTokenizer):
      # jaxpipe's byte models; a vocabulary under 256 refuses the bytes it lacks per request
      return tokenizer_lib.ByteTokenizer(max(cfg.vocab, tokenizer_lib.BYTES))
    tokenizer_lib.check_vocab(tok, cfg.vocab)
  except ValueError as e:
    sys.exit(f"error: {e}")
  return tok


def _drafter(cfg, kw: dict):
  """--speculative draft: a `ModelDrafter` over --draft_workdir's model (refused: one line)."""
  from jaxpipe.serve.drafter import ModelDrafter
  from jaxpipe.training import config as config_lib
  from jaxpipe.training import restore

  if not _DRAFT_WORKDIR.value:
    sys.exit("error: --speculative draft needs --draft_workdir (the draft model's workdir)")
  try:
    config = restore.run_config(_DRAFT_WORKDIR.value)
    _, params = restore.restore_params(_DRAFT_WORKDIR.value, config, dtype=_DTYPE.value)
  except (FileNotFoundError, RuntimeError) as e:
    sys.exit(f"error: --draft_workdir: {e}")
  draft = config_lib.model_config(config)
  if draft.vocab != cfg.vocab:
    sys.exit(
        f"error: the draft model's vocabulary ({draft.vocab}) is not the served model's "
        f"({cfg.vocab}); give a draft model with the same tokenizer"
    )
  if _DTYPE.value is not None:
    draft, params = in_dtype(draft, params, _DTYPE.value)
  fields = ("page_size", "num_pages", "max_batch", "max_tokens_per_step", "max_seq_len")
  return ModelDrafter(draft, params, **{f: kw[f] for f in fields}, attention=kw["attention"])


def _model_context(workdir: str | None) -> int | None:
  """A converted checkpoint's max_position_embeddings (WORKDIR/hf/config.json), else None."""
  if not workdir:
    return None
  path = os.path.join(workdir, tokenizer_lib.HF_DIR, "config.json")
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f).get("max_position_embeddings")
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    sys.exit(f"error: {path}: {e}")
  return value if isinstance(value, int) and value > 0 else None


def _deployment(cfg, params, kw: dict):
  """--mode colocated or disaggregated: workers on disjoint groups of --devices_per_worker."""
  from jaxpipe.serve import deploy

  n = _DEVICES_PER_WORKER.value
  if _MODE.value == "colocated":
    return deploy.Colocated(cfg, params, deploy.device_groups(_WORKERS.value, n), **kw)
  p = _PREFILL_WORKERS.value
  groups = deploy.device_groups(p + _DECODE_WORKERS.value, n)
  return deploy.Disaggregated(cfg, params, groups[:p], groups[p:], **kw)


def _serve_http(backend, cfg, source: str, tok) -> None:
  import jax

  try:
    from jaxpipe.serve.http import CompletionServer, engines_of
  except ImportError as e:
    sys.exit(f"error: --http needs the serving extra ({e}); pip install 'jaxpipe[serve]'")
  name = _model_name()
  start = time.perf_counter()
  backend.precompile()
  engines = engines_of(backend)
  engine = engines[-1]  # a decode worker's settings when disaggregated
  # Sequences running at once: every worker's batch, a decode worker's when disaggregated.
  batch = engine.max_batch * len([e for e in engines if not e.prefill_only])
  info = {
      "mode": _MODE.value,
      "workers": len(engines),
      "page_size": engine.page_size,
      "num_pages": engine.num_pages,
      "max_batch": engine.max_batch,
      "max_tokens_per_step": engine.max_tokens_per_step,
      "max_seq_len": engine.max_seq_len,
      "token_buckets": list(engine.token_buckets),
      "page_buckets": list(engine.page_buckets),
      "attention": engine.backend,
      "matmul": engine.matmul,
      "kv_cache_dtype": _KV_CACHE_DTYPE.value,
      "tokenizer": type(tok).__name__,
      "eos_ids": list(tok.eos_ids),
      "device": jax.devices()[0].device_kind,
      "source": source,
      "model": dataclasses.asdict(cfg),
  }
  try:
    server = CompletionServer(
        backend,
        model_name=name,
        max_batch=batch,
        max_queue=_MAX_QUEUE.value,
        drain_s=_DRAIN_S.value,
        engine_info=info,
        tokenizer=tok,
        tool_call_parser=_TOOL_CALL_PARSER.value,
        api_key=_api_key(),
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  programs = sum(len(e.programs) for e in engines)
  workers = f" ({len(engines)} workers)" if len(engines) > 1 else ""
  print(
      f"# {source}; {jax.devices()[0].platform}, {_MODE.value}{workers}{_spans(engine)}, paged "
      f"attention {engine.backend}, matmul {engine.matmul}, {programs} step programs compiled in "
      f"{time.perf_counter() - start:.1f} s; "
      + "".join(f"{e.rings_note()}; " for e in engines[:1] if e.ring_size)
      + f"serving {name!r} on http://{_HOST.value}:{_PORT.value} (SIGTERM drains for "
      f"{_DRAIN_S.value:g} s)",
      flush=True,
  )
  try:
    server.run(_HOST.value, _PORT.value)
  except OSError as e:
    sys.exit(f"error: {e}")
  print("# drained; exiting", flush=True)


def _model_name() -> str:
  return _MODEL_NAME.value or os.path.basename(
      os.path.normpath(
          _WORKDIR.value or os.path.splitext(config_flags.get_config_filename(FLAGS["config"]))[0]
      )
  )


def _from_flag_or_env(flag, env: str) -> str | None:
  """A flag's value, else the environment's (which keeps a secret out of `ps`)."""
  return flag.value if flag.value is not None else os.environ.get(env)


def _api_key() -> str | None:
  """--api_key, else $JAXPIPE_API_KEY."""
  return _from_flag_or_env(_API_KEY, "JAXPIPE_API_KEY")


def _secret() -> str | None:
  """--fleet_secret, else $JAXPIPE_FLEET_SECRET."""
  return _from_flag_or_env(_FLEET_SECRET, "JAXPIPE_FLEET_SECRET")


def _serve_worker(engine, source: str) -> None:
  """--role prefill|decode|replica: the engine served to a router until SIGTERM drains it."""
  try:
    from jaxpipe.serve.fleet.worker import WorkerServer
  except ImportError as e:
    sys.exit(f"error: --role needs the serving extra ({e}); pip install 'jaxpipe[serve]'")
  start = time.perf_counter()
  role = _ROLE.value
  try:
    server = WorkerServer(
        engine,
        role,
        transfer_address=_TRANSFER_ADDRESS.value,
        fleet_secret=_secret(),
        offer_timeout_s=_OFFER_TIMEOUT_S.value,
        pull_timeout_s=_PULL_TIMEOUT_S.value,
        drain_s=_DRAIN_S.value,
        info={"model": _model_name(), "source": source},
    )
    # the K/V moves of a whole context, and every step program
    engine.precompile(None, 0 if role == "replica" else engine.max_pages_per_seq)
  except (ValueError, RuntimeError) as e:
    sys.exit(f"error: {e}")
  wire = f", K/V transfer server on {server.wire.address}" if server.wire else ""
  print(
      f"# {source}; {role} server, paged attention {engine.backend}, matmul {engine.matmul}, "
      f"{len(engine.programs)} step "
      f"programs compiled in {time.perf_counter() - start:.1f} s{wire}; serving on "
      f"http://{_HOST.value}:{_PORT.value} (SIGTERM drains for {_DRAIN_S.value:g} s)",
      flush=True,
  )
  try:
    server.run(_HOST.value, _PORT.value)
  except OSError as e:
    sys.exit(f"error: {e}")
  print("# drained; exiting", flush=True)


def _serve_router(cfg, tok) -> None:
  """--role router: the OpenAI API over a fleet of servers, until SIGTERM drains it."""
  try:
    from jaxpipe.serve.fleet import routing
    from jaxpipe.serve.fleet.router import FleetBackend
    from jaxpipe.serve.http import CompletionServer
  except ImportError as e:
    sys.exit(f"error: --role router needs the serving extra ({e}); pip install 'jaxpipe[serve]'")
  try:
    policy = routing.RoutingConfig(
        _ROUTING.value, _CACHE_THRESHOLD.value, _BALANCE_ABS.value, _BALANCE_REL.value
    )
    backend = FleetBackend(
        prefill_urls=_PREFILL_URLS.value,
        decode_urls=_DECODE_URLS.value,
        replica_urls=_REPLICA_URLS.value,
        fleet_secret=_secret(),
        routing_config=policy,
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  if backend.limits.vocab != cfg.vocab:
    sys.exit(
        f"error: the servers' model has {backend.limits.vocab} token ids, this config's "
        f"{cfg.vocab}; give the router the servers' --workdir"
    )
  name = _model_name()
  info = {
      "mode": "router",
      "servers": {s.url: s.role for s in backend.servers},
      "routing": dataclasses.asdict(policy),
      "tokenizer": type(tok).__name__,
      "eos_ids": list(tok.eos_ids),
      "model": dataclasses.asdict(cfg),
  }
  try:
    server = CompletionServer(
        backend,
        model_name=name,
        max_batch=backend.max_batch,
        max_queue=_MAX_QUEUE.value,
        drain_s=_DRAIN_S.value,
        engine_info=info,
        tokenizer=tok,
        tool_call_parser=_TOOL_CALL_PARSER.value,
        api_key=_api_key(),
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  kinds = collections.Counter(s.role for s in backend.servers)
  print(
      f"# router over {', '.join(f'{n} {role}' for role, n in kinds.items())} servers "
      f"({_ROUTING.value}); serving {name!r} on http://{_HOST.value}:{_PORT.value} (SIGTERM "
      f"drains for {_DRAIN_S.value:g} s)",
      flush=True,
  )
  try:
    server.run(_HOST.value, _PORT.value)
  except OSError as e:
    sys.exit(f"error: {e}")
  finally:
    backend.close()
  print("# drained; exiting", flush=True)


if __name__ == "__main__":
  cli.run(main)
