"""Why a request cannot be served: the message and the request field it is about.

The engine, a deployment and the sampling values answer a bad request with a `Refusal`; the HTTP
server sends its `param` as the OpenAI error's `param` and its text as the message, so no layer
works out the field from the words.
"""

from __future__ import annotations


class Refusal(str):
  """A refusal's message (the string itself) and `param`, the request field it names.

  A `str`, so that callers that raise or print the reason keep doing so.
  """

  param: str

  def __new__(cls, message: str, param: str) -> Refusal:
    """Args:
      message: one line saying what is wrong and the fix.
      param: the request field at fault (`max_tokens`, `prompt`, `temperature`, ...).

    Returns:
      The refusal: `message` as a string, with `.param`.
    """
    out = super().__new__(cls, message)
    out.param = param
    return out

  def prefixed(self, prefix: str) -> Refusal:
    """The same refusal with `prefix` before its message (e.g. which prompt of a list).

    Args:
      prefix: text to put first.

    Returns:
      The new `Refusal`, with the same `param`.
    """
    return Refusal(prefix + self, self.param)
