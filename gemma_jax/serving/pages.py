"""The pages of one attention type's pool: who holds each, which are free, and which
hold a cached prefix.

A page holds P consecutive tokens of one sequence (a block). It is held by the
sequences whose page tables list it and, once full, by the prefix cache, which keys it
by the tokens of its block and of every block before it (`block_key`): two sequences
with the same first k blocks share their pages. A page no one holds is free; a page
only the cache holds is evictable, least recently used first, when the free ones run
out.
"""

import collections
import hashlib
from typing import Dict, Hashable, List, Optional, Sequence

import numpy as np


def block_keys(tokens: Sequence[int], page_size: int, salt: bytes = b"") -> List[bytes]:
  """The cache key of each full block of `tokens`: the SHA-256 of block b's tokens and
  the key of block b - 1 (of `salt` for block 0: what else the tokens mean, e.g. the
  images of their placeholders), so a key names the whole prefix up to its block's end.
  A cryptographic digest, so that no prompt can be made to collide with another user's
  prefix and read its cached keys and values."""
  keys, key = [], salt
  for start in range(0, len(tokens) - page_size + 1, page_size):
    block = np.asarray(tokens[start:start + page_size], np.int64).tobytes()
    key = hashlib.sha256(key + block).digest()
    keys.append(key)
  return keys


class PagePool:
  """Holders of the pages 0..num_pages - 1 of one pool (host-side bookkeeping)."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._holders = [0] * num_pages                 # sequences holding each page
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: the last freed is reused first
    self._cached: "collections.OrderedDict[Hashable, int]" = collections.OrderedDict()
    self._key_of: Dict[int, Hashable] = {}
    self._cached_only = 0                            # cached pages no sequence holds

  @property
  def available(self) -> int:
    """Pages an allocation may take: free, or held by the cache alone."""
    return len(self._free) + self._cached_only

  @property
  def in_use(self) -> int:
    """Pages held by a sequence."""
    return self.num_pages - len(self._free) - self._cached_only

  @property
  def cached_only(self) -> int:
    """Pages only the prefix cache holds (evictable)."""
    return self._cached_only

  def allocate(self) -> Optional[int]:
    """A page for a sequence (held once), or None when every page is held."""
    if not self._free:
      for key, page in self._cached.items():   # least recently used first
        if not self._holders[page]:
          del self._cached[key], self._key_of[page]
          self._free.append(page)
          self._cached_only -= 1
          break
    if not self._free:
      return None
    page = self._free.pop()
    self._holders[page] = 1
    return page

  def hold(self, page: int) -> None:
    """One more sequence holds `page` (a cached prefix page it now lists)."""
    if not self._holders[page] and page in self._key_of:
      self._cached_only -= 1
    self._holders[page] += 1

  def release(self, page: int) -> None:
    """A sequence lets go of `page`; free when no one, cache included, holds it."""
    self._holders[page] -= 1
    if self._holders[page] < 0:
      raise RuntimeError(f"page {page} released more often than held")
    if not self._holders[page]:
      if page in self._key_of:
        self._cached_only += 1
      else:
        self._free.append(page)

  def lookup(self, key: Hashable) -> Optional[int]:
    """The cached page of the block `key` names (marked recently used), or None."""
    page = self._cached.get(key)
    if page is not None:
      self._cached.move_to_end(key)
    return page

  def cache(self, key: Hashable, page: int) -> None:
    """Keeps the full page `page` as the block `key` names (if no page holds it yet)."""
    if key in self._cached or page in self._key_of:
      return
    self._cached[key] = page
    self._key_of[page] = key
    if not self._holders[page]:
      self._cached_only += 1
