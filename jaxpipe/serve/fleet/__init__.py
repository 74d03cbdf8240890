"""Serving past one process: prefill, decode and replica servers behind a router.

- `worker.WorkerServer`: one engine served to a router over HTTP (`/fleet/...` routes, token ids
  only). A `prefill` server computes a prompt and its first token and offers the request's K/V
  pages on its transfer server (`serve.kv_wire`); a `decode` server pulls them by ticket and
  streams the rest; a `replica` does both, as one colocated engine.
- `router.FleetBackend`: the router's backend, driven by the OpenAI server
  (`serve.http.CompletionServer`) like an engine: it sends each request to a prefill server and
  then a decode server (or to one replica) and streams their tokens back.
- `routing`: where a request goes: SGLang's cache-aware rule over each server's prompt prefixes,
  or the least-loaded server by KV pages.

    python -m jaxpipe.serve --workdir W --role prefill --port 8001
    python -m jaxpipe.serve --workdir W --role decode --port 8002
    python -m jaxpipe.serve --workdir W --role router --port 8000 \\
        --prefill_urls http://127.0.0.1:8001 --decode_urls http://127.0.0.1:8002
"""
