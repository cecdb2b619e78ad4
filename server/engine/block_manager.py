"""BlockManager: the pool of KV-cache blocks, their ref counts and the prefix cache over full blocks.

Pure bookkeeping: it never touches tensors. A block is in exactly one of three states:
  free    ref 0, no hash            in `free_block_ids`, handed out first
  cached  ref 0, hash registered    in `cached_block_ids` (LRU order), reusable by a prefix hit or evictable
  live    ref > 0                   in the block tables of one or more requests (more than one only via a hit)
"""

from collections import OrderedDict, deque
from collections.abc import Sequence

from server.engine.request_state import Request

ROOT_HASH = 0  # parent hash of a request's first block


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Identity of a full block: its tokens plus, through the parent, every token before it.

    Python's hash of a tuple of ints is stable within a process (ints are not salted), which is all a
    cache that lives and dies with the process needs.
    """
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0
    ):
        """num_state_slots: a hybrid model's per-sequence state slots (model/kv_cache.py), one per running
        request, taken with its first blocks and given back with them; 0: the model has none."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks  # set only on the block the index points to
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.hash_to_block: dict[int, int] = {}
        # request id -> chained hashes of its full blocks so far; the parent of the next block is the last one
        self.request_hashes: dict[str, list[int]] = {}
        # in tokens; counted once per request, at its first admission (see allocate)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.free_state_slots: deque[int] = deque(range(num_state_slots))
        self.uses_state_slots = num_state_slots > 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: the free ones plus cached ones nobody holds (evictable)."""
        return len(self.free_block_ids) + len(self.cached_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests; cached idle blocks count as free, so idle = 0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached full-block prefix of the request's tokens. No side effects.

        The hit stops one token short of the whole sequence: the model must compute at least one token
        to produce the logits of the next one.
        """
        if not self.enable_prefix_caching:
            return []
        token_ids = request.all_token_ids
        bs = self.block_size
        block_ids = []
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.hash_to_block.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate(self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Grow the request's block table until it has slots for its first `num_tokens` tokens.

        `cached_block_ids` (from find_cached_prefix) go first, shared; only for a request holding no blocks.
        Returns False, changing nothing, when there are not enough free blocks.
        """
        assert not cached_block_ids or not request.block_table
        num_held = len(request.block_table) + len(cached_block_ids)
        num_new = -(-num_tokens // self.block_size) - num_held
        # a hit on an idle cached block takes it out of the evictable pool that new blocks come from
        num_revived = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        if num_new > self.num_free_blocks - num_revived:
            return False
        if self.uses_state_slots and request.state_slot is None:
            if not self.free_state_slots:
                return False
            request.state_slot = self.free_state_slots.popleft()

        # Counted at the first admission only: a recompute after preemption also reuses the cache, but
        # counting it again would make the hit rate reflect memory pressure rather than client traffic.
        if self.enable_prefix_caching and not request.block_table and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += len(cached_block_ids) * self.block_size

        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_block_ids[block_id]
            self.ref_counts[block_id] += 1
            request.block_table.append(block_id)
        if cached_block_ids:
            self.request_hashes[request.request_id] = [self.block_hashes[b] for b in cached_block_ids]
        for _ in range(num_new):
            request.block_table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            # evict the least recently used cached block; its contents are about to be overwritten
            block_id, _ = self.cached_block_ids.popitem(last=False)
            h = self.block_hashes[block_id]
            assert self.hash_to_block[h] == block_id
            del self.hash_to_block[h]
            self.block_hashes[block_id] = None
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full of computed tokens (prompt or generated) so that
        later requests can hit them. Call after advancing request.num_computed_tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self.request_hashes.setdefault(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        token_ids = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            h = block_hash(hashes[-1] if hashes else ROOT_HASH, token_ids[i * bs : (i + 1) * bs])
            block_id = request.block_table[i]
            # When another block already holds these tokens (both computed at once), that one stays the
            # cached copy and this one remains anonymous: it returns to the free list when released.
            if h not in self.hash_to_block:
                assert self.block_hashes[block_id] is None
                self.block_hashes[block_id] = h
                self.hash_to_block[h] = block_id
            hashes.append(h)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the request's first num_tokens tokens (held for drafts it did not keep:
        never hashed, never shared)."""
        num_needed = -(-num_tokens // self.block_size)
        while len(request.block_table) > num_needed:
            block_id = request.block_table.pop()
            assert self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None
            self.ref_counts[block_id] = 0
            self.free_block_ids.append(block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail first, so that in the LRU the tail of a prefix is evicted
        before its head (a head block is useful to more future prompts than a tail block)."""
        for block_id in reversed(request.block_table):
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.cached_block_ids[block_id] = None  # most recently used
        request.block_table.clear()
        self.request_hashes.pop(request.request_id, None)
        if request.state_slot is not None:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None

    def check_invariants(self) -> None:
        """Assert that every block is in exactly one state; O(num_blocks), for tests and debugging."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            ref, h = self.ref_counts[block_id], self.block_hashes[block_id]
            assert ref >= 0
            assert (ref == 0) == (block_id in free or block_id in self.cached_block_ids)
            assert block_id not in free or h is None
            assert block_id not in self.cached_block_ids or h is not None
            assert h is None or self.hash_to_block[h] == block_id
        assert len(self.hash_to_block) == sum(h is not None for h in self.block_hashes)
