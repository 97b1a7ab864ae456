"""One request's sequence in the engine, and the pages it holds.

A sequence's tokens are its prompt then what it has generated; `filled` of them are in
the cache (positions 0..filled - 1). It prefills all but its last token in chunks, then
decodes: each step feeds its last token at position `filled` and appends the choice.
Its pages, per attention type, are listed by block (None: none held); a local type
lets go of the blocks behind its window.
"""

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

from gemma_jax.serving.pages import PagePool, block_keys
from gemma_jax.serving.requests import Request
from gemma_jax.serving.stops import StopText


@dataclasses.dataclass(eq=False)
class Sequence:
  """A request as the engine runs it."""
  id: int
  request: Request
  on_output: Callable
  seed: int
  tokens: List[int]
  stops: Optional[StopText]
  generated: int = 0
  filled: int = 0
  slot: Optional[int] = None
  blocks: Dict[str, List[Optional[int]]] = dataclasses.field(default_factory=dict)
  images: Any = None        # the model's images of the prompt's placeholders, batch of 1
  salt: bytes = b""         # what its prefix keys add to its tokens (a digest of images)
  soft: Any = None          # [max_length + chunk, D] placeholder embeddings, once admitted
  keys: List[bytes] = dataclasses.field(default_factory=list)   # its full blocks' keys
  offered: int = 0          # leading full blocks already offered to the prefix cache
  submitted: float = dataclasses.field(default_factory=time.monotonic)
  admitted: float = 0.0
  first_token: Optional[float] = None

  @property
  def prefilling(self) -> bool:
    return self.filled < len(self.tokens) - 1


class Pages:
  """Every attention type's `PagePool`, and the blocks of sequences in them."""

  def __init__(self, num_pages: Dict[str, int], page_size: int, window: Optional[int]):
    self.pools = {kind: PagePool(n) for kind, n in num_pages.items()}
    self.page_size = page_size
    self.window = window

  def _needed(self, kind: str, start: int, end: int) -> range:
    """Blocks a sequence needs of type `kind` to write positions start..end - 1 and attend
    from them."""
    first = max(start - self.window + 1, 0) if kind == "local" else 0
    return range(first // self.page_size, -(-end // self.page_size))

  def _keys(self, seq: Sequence, length: int) -> List[bytes]:
    """The prefix cache's keys of the full blocks of seq's first `length` tokens, each
    computed once (a sequence's tokens only grow)."""
    done, p = len(seq.keys), self.page_size
    if length // p > done:
      seq.keys += block_keys(seq.tokens[done * p:length], p,
                             seq.keys[-1] if seq.keys else seq.salt)
    return seq.keys[:length // p]

  def reuse_prefix(self, seq: Sequence) -> int:
    """Lists the cached pages of the longest prefix of seq's tokens (all but the last)
    whose blocks every type holds: the positions now filled."""
    keys = self._keys(seq, len(seq.tokens) - 1)
    k = 0
    while k < len(keys) and all(pool.lookup(keys[k]) is not None
                                for kind, pool in self.pools.items() if kind != "local"):
      k += 1
    while k and not all(self.pools[kind].lookup(keys[b]) is not None
                        for kind in self.pools
                        for b in self._needed(kind, k * self.page_size, k * self.page_size)):
      k -= 1
    for kind, pool in self.pools.items():
      seq.blocks[kind] = [None] * k
      for b in self._needed(kind, k * self.page_size, k * self.page_size):
        page = pool.lookup(keys[b])
        pool.hold(page)
        seq.blocks[kind][b] = page
    seq.offered = k
    return k * self.page_size

  def fits(self, seq: Sequence, start: int, end: int) -> bool:
    """Whether every type has the pages to write positions start..end - 1 of seq."""
    return all(sum(1 for b in self._needed(kind, start, end)
                   if b >= len(seq.blocks[kind]) or seq.blocks[kind][b] is None)
               <= pool.available for kind, pool in self.pools.items())

  def allocate(self, seq: Sequence, start: int, end: int) -> bool:
    """Pages for positions start..end - 1 of seq (the blocks behind a local window let
    go); False, with nothing taken, when a pool runs out."""
    if not self.fits(seq, start, end):
      return False
    self.release_behind(seq, start)
    for kind, pool in self.pools.items():
      blocks = seq.blocks[kind]
      needed = self._needed(kind, start, end)
      blocks.extend([None] * (needed.stop - len(blocks)))
      for b in needed:
        if blocks[b] is None:
          blocks[b] = pool.allocate()
    return True

  def release_behind(self, seq: Sequence, position: int) -> None:
    """Lets go of the blocks a query at `position` no longer reads (local ones behind its
    window)."""
    for kind, pool in self.pools.items():
      blocks = seq.blocks[kind]
      for b in range(min(self._needed(kind, position, position).start, len(blocks))):
        if blocks[b] is not None:
          pool.release(blocks[b])
          blocks[b] = None

  def cache_full_blocks(self, seq: Sequence) -> None:
    """Offers seq's full, written blocks not offered yet to the prefix cache."""
    keys = self._keys(seq, seq.filled)
    for kind, pool in self.pools.items():
      for b in range(seq.offered, len(keys)):
        if seq.blocks[kind][b] is not None:
          pool.cache(keys[b], seq.blocks[kind][b])
    seq.offered = len(keys)

  def release(self, seq: Sequence) -> None:
    """Lets go of every page seq holds."""
    for kind, pool in self.pools.items():
      for page in seq.blocks.get(kind, ()):
        if page is not None:
          pool.release(page)
      seq.blocks[kind] = []

  def table_row(self, seq: Sequence, kind: str, max_blocks: int) -> List[int]:
    """seq's page per block of `kind`, 0 where it holds none (masked there)."""
    row = [0 if page is None else page for page in seq.blocks[kind][:max_blocks]]
    return row + [0] * (max_blocks - len(row))
