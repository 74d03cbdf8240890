"""Who may call: a Bearer token on every request, as vLLM's `--api-key` asks for it.

With a key set, each HTTP request but the monitoring routes (`/health`, `/ready`, `/metrics`,
`/version`) and CORS preflights must carry `Authorization: Bearer <key>`; the header is compared
in constant time (`hmac.compare_digest`). A request without it gets 401 with an OpenAI-style
error body, which the `openai` package raises as `AuthenticationError`.
"""

from __future__ import annotations

import hmac
import json

OPEN = ("/health", "/ready", "/metrics", "/version")  # monitoring: readable without the key


class ApiKey:
  """ASGI middleware that turns away requests without the server's Bearer token."""

  def __init__(self, app, key: str, guarded: str = "/", what: str = "API key"):
    """Args:
    app: the ASGI app it guards.
    key: the token clients send (non-empty: `CompletionServer` checks).
    guarded: the paths under this prefix need the key (monitoring's never do).
    what: the key's name in the 401's message.
    """
    self.app = app
    self._want = b"Bearer " + key.encode()
    self._guarded, self._what = guarded, what

  async def __call__(self, scope, receive, send):
    if (
        scope["type"] != "http"
        or scope["method"] == "OPTIONS"
        or scope["path"] in OPEN
        or not scope["path"].startswith(self._guarded)
    ):
      await self.app(scope, receive, send)
      return
    got = dict(scope["headers"]).get(b"authorization", b"")
    if hmac.compare_digest(got, self._want):
      await self.app(scope, receive, send)
      return
    body = json.dumps(
        {
            "error": {
                "message": f"a valid {self._what} is needed: send 'Authorization: Bearer <key>'",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
