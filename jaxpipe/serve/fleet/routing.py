"""Where a router sends a request: SGLang's cache-aware rule, or the least-loaded server.

The router keeps, per server, the prompt prefixes it sent there (`PrefixIndex`: chained hashes
of whole pages, the most recently used kept up to the server's pool): an approximation of what
that server's prefix cache holds, as SGLang's router keeps an approximate radix tree. A
server's load is the KV pages of the requests the router has in flight there (each request's
prompt + max_tokens, in pages): what it will hold at most.

`choose` (SGLang's cache-aware policy, loads in KV pages):
- When the loads are uneven, `max - min > balance_abs_threshold` and `max > balance_rel_threshold
  * min`, the least-loaded server.
- Otherwise the server with the longest cached prefix, if it covers at least `cache_threshold`
  of the prompt.
- Otherwise the least-loaded server.
With `policy="least_loaded"`, always the least-loaded server. Ties go to the first listed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

POLICIES = ("cache_aware", "least_loaded")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """How the router picks a server among those of one role."""

  policy: str = "cache_aware"  # or "least_loaded"
  cache_threshold: float = 0.5  # route by prefix when it covers at least this share of a prompt
  balance_abs_threshold: int = 32  # loads (KV pages) this far apart ...
  balance_rel_threshold: float = 1.5  # ... and this many times apart are uneven: least-loaded

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"routing policy {self.policy!r}: use one of {', '.join(POLICIES)}")
    if not 0 <= self.cache_threshold <= 1:
      raise ValueError(f"cache_threshold={self.cache_threshold} must lie in [0, 1]")
    if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
      raise ValueError(
          f"balance_abs_threshold={self.balance_abs_threshold} must be >= 0 and "
          f"balance_rel_threshold={self.balance_rel_threshold} >= 1"
      )


class PrefixIndex:
  """The prompt prefixes sent to one server, as chained hashes of whole pages (LRU)."""

  def __init__(self, page_size: int, capacity: int):
    """Args:
    page_size: tokens per page (the server's).
    capacity: pages remembered at most (the server's pool); the least recently used go first.
    """
    self.page_size, self.capacity = page_size, capacity
    self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()

  def _keys(self, tokens: Sequence[int]) -> list[int]:
    keys, h = [], 0
    for at in range(0, len(tokens) - self.page_size + 1, self.page_size):
      h = hash((h, tuple(tokens[at : at + self.page_size])))
      keys.append(h)
    return keys

  def match(self, tokens: Sequence[int]) -> int:
    """Tokens of the longest remembered prefix of `tokens` (whole pages).

    Args:
      tokens: a prompt.

    Returns:
      The matched length in tokens.
    """
    n = 0
    for key in self._keys(tokens):
      if key not in self._pages:
        break
      n += 1
    return n * self.page_size

  def insert(self, tokens: Sequence[int]) -> None:
    """Remembers a prompt's whole pages as used now.

    Args:
      tokens: the prompt sent to the server.
    """
    for key in self._keys(tokens):
      self._pages[key] = None
      self._pages.move_to_end(key)
    while len(self._pages) > self.capacity:
      self._pages.popitem(last=False)

  def __len__(self) -> int:
    return len(self._pages)


def choose(
    loads: Sequence[int],
    matches: Sequence[int] | None,
    prompt_len: int,
    cfg: RoutingConfig,
) -> tuple[int, str]:
  """The server a request goes to, among candidates of one role.

  Args:
    loads: each candidate's load (KV pages of the requests in flight there).
    matches: each candidate's cached prefix of the prompt in tokens (None: no prefix caching).
    prompt_len: the prompt's tokens.
    cfg: the rule.

  Returns:
    (the candidate's index, why: "prefix", "balance" or "least_loaded").
  """
  least = min(range(len(loads)), key=lambda i: loads[i])
  if cfg.policy == "least_loaded" or matches is None:
    return least, "least_loaded"
  hi, lo = max(loads), min(loads)
  if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
    return least, "balance"
  best = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
  if matches[best] and matches[best] >= cfg.cache_threshold * prompt_len:
    return best, "prefix"
  return least, "least_loaded"
