"""Host-side KV page bookkeeping: a reference-counted page allocator and a prefix cache.

Pages are ids into the device pools' page axis. Page 0 is the scratch page: never handed out,
it is where padding tokens write and where unused block-table entries point. A page is owned
by every sequence whose block table holds it and by the prefix cache entry that names it; its
count is the number of those owners, and it returns to the free list when the count reaches 0.
A sequence about to write into a page that others also own copies it first (`writable`).

The lowest free page is handed out first: a pool that drains between bursts of work lays the
next burst's pages out as the first's (each prompt's pages consecutive), where a first-in
first-out list would scatter them in the order the last burst's sequences finished and the
attention kernels would read them from scattered addresses (at SmolLM2-135M's shape in bfloat16,
rounds of 64 requests ran 10% slower once scattered: docs/serving.md).
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from collections.abc import Callable, Sequence

import numpy as np

SCRATCH_PAGE = 0


class OutOfPages(Exception):
  """No free page (after evicting what the prefix cache could give back)."""


class PageAllocator:
  """Free pages (lowest first) and reference counts over pages 1..num_pages-1."""

  def __init__(self, num_pages: int, on_free: Callable[[int], None] | None = None):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the scratch page)")
    self.num_pages = num_pages
    self.refs = np.zeros(num_pages, np.int32)
    self._free = list(range(1, num_pages))  # a heap: `alloc` hands out the lowest
    self._on_free = on_free
    self.reclaim: Callable[[int], int] | None = None  # frees up to n pages on demand (prefix cache)

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def alloc(self) -> int:
    """The lowest free page, with count 1; OutOfPages when none is free even after reclaiming."""
    if not self._free and self.reclaim is not None:
      self.reclaim(1)
    if not self._free:
      raise OutOfPages
    page = heapq.heappop(self._free)
    self.refs[page] = 1
    return page

  def can_alloc(self, n: int) -> bool:
    """Whether n pages can be allocated now, reclaiming from the prefix cache if needed.

    Args:
      n: pages wanted.

    Returns:
      True if at least n pages are free (after reclaiming).
    """
    if len(self._free) < n and self.reclaim is not None:
      self.reclaim(n - len(self._free))
    return len(self._free) >= n

  def incref(self, page: int) -> None:
    """One more owner of an owned page.

    Args:
      page: the page.

    Raises:
      ValueError: the page is free; only an owned page can be shared.
    """
    if self.refs[page] < 1:
      raise ValueError(f"page {page} is free; only an owned page can be shared")
    self.refs[page] += 1

  def decref(self, page: int) -> None:
    """One owner fewer; the page returns to the free list when none is left.

    Args:
      page: the page.

    Raises:
      ValueError: the page is already free (double free).
    """
    if self.refs[page] < 1:
      raise ValueError(f"page {page} is already free (double free)")
    self.refs[page] -= 1
    if self.refs[page] == 0:
      heapq.heappush(self._free, page)
      if self._on_free is not None:
        self._on_free(page)

  def fork(self, pages: Sequence[int]) -> list[int]:
    """Another owner for every page of a block table (a second sample of the same prefix).

    Args:
      pages: the block table.

    Returns:
      A copy of it, the fork's block table.

    Raises:
      ValueError: a page that is free.
    """
    for p in pages:
      self.incref(p)
    return list(pages)

  def free(self, pages: Sequence[int]) -> None:
    """One owner fewer for every page of a block table (`decref`).

    Args:
      pages: the block table.

    Raises:
      ValueError: a page that is already free (double free).
    """
    for p in pages:
      self.decref(p)

  def writable(self, page: int) -> tuple[int, int | None]:
    """(page to write, source to copy it from or None): copy-on-write for a shared page.

    A shared page is replaced by a fresh one (the caller copies the source into it), and this
    owner gives the shared one up.

    Args:
      page: a page this owner holds.

    Returns:
      (page, None) for a page only this owner holds; (new page, page) for a shared one.

    Raises:
      OutOfPages: a shared page and no free page; nothing changes then.
    """
    if self.refs[page] == 1:
      return page, None
    new = self.alloc()  # before the decref: a failed alloc leaves everything as it was
    self.decref(page)
    return new, page


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
  """Key of a full page: a digest of the previous page's key and this page's tokens.

  Args:
    parent: the previous page's key; b'' for the first page.
    tokens: the page's tokens.

  Returns:
    The SHA-256 digest.
  """
  return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


class PrefixCache:
  """Full pages keyed by their page-aligned token prefix; each entry owns one page count.

  Entries whose page nobody else owns are evictable, least recently used first; the allocator
  calls `evict` when its free list runs dry.
  """

  def __init__(self, allocator: PageAllocator, page_size: int):
    self.allocator, self.page_size = allocator, page_size
    self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    allocator.reclaim = self.evict

  def __len__(self) -> int:
    return len(self._pages)

  def keys_of(self, tokens: Sequence[int], full_pages: int) -> list[bytes]:
    """Keys of the first `full_pages` pages of `tokens`.

    Args:
      tokens: the sequence's tokens.
      full_pages: pages to key, each of page_size tokens.

    Returns:
      [full_pages] keys, each chained on the one before (`page_key`).
    """
    keys, parent, s = [], b"", self.page_size
    for i in range(full_pages):
      parent = page_key(parent, tokens[i * s : (i + 1) * s])
      keys.append(parent)
    return keys

  def match(self, tokens: Sequence[int]) -> list[int]:
    """The cached pages of the longest cached page-aligned prefix of `tokens`, each now shared.

    Args:
      tokens: the sequence's tokens.

    Returns:
      The pages, in order; each has one more owner (the caller), and its entry is the most
      recently used.
    """
    pages = []
    for key in self.keys_of(tokens, len(tokens) // self.page_size):
      page = self._pages.get(key)
      if page is None:
        break
      self._pages.move_to_end(key)
      self.allocator.incref(page)
      pages.append(page)
    return pages

  def insert(self, key: bytes, page: int) -> None:
    """Caches `page` under `key` (a no-op if the key is cached already).

    Args:
      key: the page's key (`page_key`).
      page: the full page; the entry becomes one more owner of it.
    """
    if key in self._pages:
      self._pages.move_to_end(key)
      return
    self.allocator.incref(page)
    self._pages[key] = page

  def evict(self, n: int) -> int:
    """Drops up to n least recently used entries that alone own their page.

    Args:
      n: entries to drop.

    Returns:
      How many were dropped.
    """
    victims = [k for k, p in self._pages.items() if self.allocator.refs[p] == 1][:n]
    for key in victims:
      self.allocator.decref(self._pages.pop(key))
    return len(victims)

  def clear(self) -> None:
    for page in self._pages.values():
      self.allocator.decref(page)
    self._pages.clear()
