"""Page allocator and prefix cache: random add / fork / write / free / cache sequences (hypothesis).

Owners are modelled independently of the allocator: after every operation each page's count
equals the number of block tables and cache entries that hold it, no free page is held, and at
the end, with every owner gone, every count is zero and every page is free again.
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpipe.serve.pages import SCRATCH_PAGE, OutOfPages, PageAllocator, PrefixCache

PAGE = 2


class Pages(RuleBasedStateMachine):

  @initialize(num_pages=st.integers(2, 12))
  def setup(self, num_pages):
    self.freed = []
    self.alloc = PageAllocator(num_pages, on_free=self.freed.append)
    self.cache = PrefixCache(self.alloc, PAGE)
    self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens, block table)
    self.contents: dict[int, tuple] = {}  # page -> the tokens written in it (what a read sees)

  def _grow(self, tokens, table, new_tokens):
    """Appends tokens, writing each into the sequence's last page (copy-on-write) or a new one."""
    for t in new_tokens:
      if len(tokens) % PAGE == 0:
        table.append(self.alloc.alloc())
        self.contents[table[-1]] = ()
      else:
        page, source = self.alloc.writable(table[-1])
        if source is not None:
          self.contents[page] = self.contents[source]
        table[-1] = page
      tokens.append(t)
      self.contents[table[-1]] = self.contents[table[-1]] + (t,)

  @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=7))
  def add(self, prompt):
    """A new sequence: the cached prefix first, then its own pages; all or nothing."""
    table = self.cache.match(prompt)
    tokens = list(prompt[: len(table) * PAGE])
    try:
      self._grow(tokens, table, prompt[len(tokens) :])
    except OutOfPages:
      self.alloc.free(table)
      return
    self.seqs.append((tokens, table))

  @precondition(lambda self: self.seqs)
  @rule(data=st.data())
  def fork(self, data):
    tokens, table = data.draw(st.sampled_from(self.seqs))
    self.seqs.append((list(tokens), self.alloc.fork(table)))

  @precondition(lambda self: self.seqs)
  @rule(data=st.data(), token=st.integers(0, 3))
  def write(self, data, token):
    tokens, table = data.draw(st.sampled_from(self.seqs))
    before = list(table)
    try:
      self._grow(tokens, table, [token])
    except OutOfPages:
      assert table == before

  @precondition(lambda self: self.seqs)
  @rule(data=st.data())
  def free(self, data):
    i = data.draw(st.integers(0, len(self.seqs) - 1))
    tokens, table = self.seqs.pop(i)
    self.alloc.free(table)

  @precondition(lambda self: self.seqs)
  @rule(data=st.data())
  def cache_full_pages(self, data):
    tokens, table = data.draw(st.sampled_from(self.seqs))
    full = len(tokens) // PAGE
    for key, page in zip(self.cache.keys_of(tokens, full), table[:full]):
      self.cache.insert(key, page)

  @rule(n=st.integers(1, 4))
  def evict(self, n):
    self.cache.evict(n)

  @invariant()
  def counts_are_owners(self):
    if not hasattr(self, "alloc"):
      return
    owners = np.zeros(self.alloc.num_pages, np.int32)
    for _, table in self.seqs:
      for p in table:
        owners[p] += 1
    for p in self.cache._pages.values():
      owners[p] += 1
    np.testing.assert_array_equal(owners, self.alloc.refs)
    free = list(self.alloc._free)
    assert len(set(free)) == len(free) and SCRATCH_PAGE not in free
    assert not any(owners[p] for p in free)
    assert len(free) + np.count_nonzero(owners) == self.alloc.num_pages - 1
    for tokens, table in self.seqs:  # every page reads back what its sequence wrote there
      assert sum((self.contents[p] for p in table), ()) == tuple(tokens)

  def teardown(self):
    if not hasattr(self, "alloc"):
      return
    for _, table in self.seqs:
      self.alloc.free(table)
    self.cache.clear()
    assert not self.alloc.refs.any()
    assert sorted(self.alloc._free) == list(range(1, self.alloc.num_pages))
    assert len(self.freed) == len(set(self.freed)) + sum(
        self.freed.count(p) - 1 for p in set(self.freed)
    )  # on_free fired once per free


TestPages = Pages.TestCase
TestPages.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_double_free_and_sharing_a_free_page_are_refused():
  alloc = PageAllocator(4)
  page = alloc.alloc()
  alloc.decref(page)
  with pytest.raises(ValueError, match="double free"):
    alloc.decref(page)
  with pytest.raises(ValueError, match="is free"):
    alloc.incref(page)
  with pytest.raises(ValueError, match="num_pages=1"):
    PageAllocator(1)


def test_the_lowest_free_page_goes_first_so_a_drained_pool_lays_pages_out_afresh():
  alloc = PageAllocator(9)
  # two sequences growing in turn, then freed in the order they finished (the second first)
  a, b = [], []
  for _ in range(3):
    a.append(alloc.alloc())
    b.append(alloc.alloc())
  assert (a, b) == ([1, 3, 5], [2, 4, 6])
  alloc.free(b)
  alloc.free(a[::-1])
  # the next prompt of four pages takes 1..4, consecutive, as from a fresh pool
  assert [alloc.alloc() for _ in range(4)] == [1, 2, 3, 4]
  alloc.decref(2)
  assert alloc.alloc() == 2  # a hole is filled before the pages past it


def test_eviction_frees_only_pages_nobody_else_holds_least_recently_used_first():
  alloc = PageAllocator(4)
  cache = PrefixCache(alloc, PAGE)
  a, b, c = alloc.alloc(), alloc.alloc(), alloc.alloc()
  for key, page in zip(cache.keys_of([0, 1, 2, 3, 4, 5], 3), (a, b, c)):
    cache.insert(key, page)
  alloc.incref(b)  # a second sequence holds b
  alloc.free([a, b, c])  # the first sequence ends; the cache alone holds a and c
  assert cache.match([0, 1, 9]) == [a]  # a hit makes a the most recently used
  alloc.free([a])
  assert alloc.num_free == 0
  assert alloc.alloc() == c and alloc.alloc() == a  # evicted on demand, oldest first
  with pytest.raises(OutOfPages):
    alloc.alloc()
  assert len(cache) == 1 and alloc.refs[b] == 2
