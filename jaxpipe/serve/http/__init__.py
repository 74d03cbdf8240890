"""An OpenAI-compatible HTTP server over a serving engine: completions and chat completions
(streamed as server-sent events), log-probabilities and echo, vLLM's /tokenize and /detokenize,
models, version, health and Prometheus metrics (vLLM's names beside jaxpipe's).

  python -m jaxpipe.serve --workdir /tmp/qs --http --host 127.0.0.1 --port 8000

- `protocol`: the request bodies as they parse (types, unknown fields, chat messages), OpenAI's
  error kinds, a choice's text as its tokens arrive (the model tokenizer's incremental decode,
  special tokens left out, stop sequences); no engine, no network.
- `checks`: the one place a parsed request's content is checked, each refusal naming its field
  as the request spells it.
- `logprobs`: log-probabilities in OpenAI's legacy completions and chat formats.
- `loop`: `EngineLoop`, the thread that runs the backend (an `Engine`, or a `serve.deploy`
  deployment: `Backend` is what it needs of one), fed by the handlers through a command queue.
- `metrics`: the Prometheus registry the loop and the handlers update.
- `app`: `CompletionServer`, the Starlette routes over the loop, backpressure (429), client
  disconnects cancelling their sequences, and uvicorn with SIGTERM draining.
"""

from jaxpipe.serve.http.app import CompletionServer
from jaxpipe.serve.http.loop import Backend, EngineLoop, engines_of

__all__ = ["Backend", "CompletionServer", "EngineLoop", "engines_of"]
