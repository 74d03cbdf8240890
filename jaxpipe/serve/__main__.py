"""Generate text from a trained model.

  python -m jaxpipe.serve --workdir /tmp/qs --prompt "def " --max_tokens 64
  python -m jaxpipe.serve --config configs/quickstart.py --prompt "import " --temperature 0.8
      [--prompt ...] [--top_k K] [--top_p P] [--seed S] [--max_seq_len N] [--num_pages N]

--workdir serves the newest checkpoint of a `python -m jaxpipe.train` run (its config.json
gives the model); --config serves the fresh parameters of a config file. Prompts are UTF-8
bytes, one token each (the byte-level models of the quickstarts); several --prompt flags are
served as one continuously batched workload.
"""
import sys

from jaxpipe import runtime

if __name__ == "__main__":
  runtime.use_host_devices()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file "
                                          "(get_config); serves fresh parameters.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's workdir: serve its newest checkpoint.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "Prompt text (UTF-8 bytes are the tokens).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt i samples with seed + i.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", None, "Context served (prompt + generated); "
                                    "default data.seq_len, the length the model was trained on.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 256, "KV pages per layer (page 0 is scratch).")
_ATTENTION = flags.DEFINE_string("attention", "auto", "Paged attention backend: xla, pallas, auto.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (_CONFIG.value is None) == (_WORKDIR.value is None):
    raise app.UsageError("give exactly one of --workdir (a training run) or --config (fresh "
                         "parameters)")
  if not _PROMPT.value:
    raise app.UsageError('--prompt is required, e.g. --prompt "def "')
  logging.set_verbosity(logging.WARNING)
  import jax

  from jaxpipe import config as config_lib
  from jaxpipe.serve import restore
  from jaxpipe.serve.engine import Engine
  if _WORKDIR.value:
    try:
      config = restore.run_config(_WORKDIR.value)
      step, params = restore.restore_params(_WORKDIR.value, config)
    except (FileNotFoundError, RuntimeError) as e:
      sys.exit(f"error: {e}")
    source = f"step {step} of {_WORKDIR.value}"
  else:
    config = _CONFIG.value
    params, source = restore.fresh_params(config), f"fresh parameters of {flags.FLAGS['config'].value}"
  cfg = config_lib.model_config(config)
  max_seq_len = _MAX_SEQ_LEN.value or config.data.seq_len
  try:
    # One page bucket (the whole context): a few prompts compile one program per token bucket.
    engine = Engine(cfg, params, page_size=_PAGE_SIZE.value, num_pages=_NUM_PAGES.value,
                    max_batch=min(16, len(_PROMPT.value)), max_seq_len=max_seq_len,
                    page_buckets=(-(-max_seq_len // _PAGE_SIZE.value),), attention=_ATTENTION.value)
    prompts = [list(p.encode("utf-8")) for p in _PROMPT.value]
    outputs = engine.generate(prompts, max_tokens=_MAX_TOKENS.value,
                              temperature=_TEMPERATURE.value, seed=_SEED.value, top_k=_TOP_K.value,
                              top_p=_TOP_P.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  print(f"# {source}; {jax.devices()[0].platform}, paged attention {engine.backend}, "
        f"{len(engine.programs)} compiled step programs, {engine.steps} steps")
  for prompt, out in zip(_PROMPT.value, outputs):
    print(prompt + bytes(t for t in out if t < 256).decode("utf-8", errors="replace"))
    print(f"# tokens: {out}")


if __name__ == "__main__":
  app.run(main)
