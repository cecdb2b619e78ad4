"""BlockManager: the pool of KV-cache blocks, their ref counts and the prefix cache over full blocks.

Pure bookkeeping: it never touches tensors. A request holds one block table per KV group (model/config.py's
kv_groups: the attention layers of one window each), all drawn from the one pool. A sliding-window group's blocks
that no later query can read (all of their tokens more than the window behind the request's computed tokens) go
back to the pool as the request advances; their table entries become BEHIND_WINDOW. So a Gemma 3 layer with a
512-token window holds ~33 blocks of 16 however long its sequence, where a full layer holds them all.

A block is in exactly one of three states:
  free    ref 0, no hash            in `free_block_ids`, handed out first, the last freed first (so the pages
                                    a block wrote are reused before those of the pool nobody has written, which
                                    the process does not yet hold: model/kv_cache.py)
  cached  ref 0, hash registered    in `cached_block_ids` (LRU order), reusable by a prefix hit or evictable
  live    ref > 0                   in the block tables of one or more requests (more than one only via a hit)

A hybrid model (Gated DeltaNet layers, model/deltanet.py) also needs, to resume after cached blocks, the layers'
state as it was after them: K/V alone cannot rebuild it. Its state slots are of two kinds: one per running
request (handed out with its first blocks), and snapshots, copies of a state at a block boundary keyed by that
block's chained hash, like the blocks. A snapshot is free, cached (LRU, evictable) or taken: chosen at schedule
time as the destination of a copy the step makes, and cached by update() once the step has made it. A prefix hit
of a hybrid ends at the deepest block whose snapshot is cached; the request's state starts as a copy of it.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.engine.request_state import Request

ROOT_HASH = 0  # parent hash of a request's first block
# a sliding-window group's table entry for a block its layers no longer read: no block at all (the attention
# backends read it as block 0, whose keys the window masks)
BEHIND_WINDOW = -1


def block_hash(parent_hash: int, token_ids: Sequence[int], generated: bool = False) -> int:
    """Identity of a full block: its tokens plus, through the parent, every token before it; and, where a
    prompt's tokens are computed apart (BlockManager.outputs_apart), whether it holds generated ones.

    Python's hash of a tuple of ints is stable within a process (ints are not salted), which is all a
    cache that lives and dies with the process needs.
    """
    return hash((parent_hash, tuple(token_ids), True) if generated else (parent_hash, tuple(token_ids)))


def first_block_read(window: int | None, position: int, block_size: int) -> int:
    """The first block that a query at `position` (or later) reads in a layer of this window (None: full)."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def blocks_for(windows: Sequence[int | None], block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks one request of num_tokens tokens holds at once, in KV groups of these windows, prefilled
    in chunks of at most `chunk` tokens: a full group holds all of its blocks, a sliding one those the window
    reads plus those a chunk writes."""
    n = -(-num_tokens // block_size)
    return sum(n if w is None else min(n, -(-(w - 1 + chunk) // block_size) + 1) for w in windows)


@dataclass(slots=True)
class PrefixHit:
    """What the prefix cache holds of a request's tokens (BlockManager.find_cached_prefix)."""

    num_blocks: int = 0  # full blocks of its tokens to start from
    # per KV group, the cached blocks to start from, shared (a sliding group's: BEHIND_WINDOW before its window)
    tables: list[list[int]] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # the chained hashes of those num_blocks blocks
    snapshot: int | None = None  # a hybrid's: the state slot holding its DeltaNet state after those blocks
    # full blocks of its tokens cached in all, past block_ids too: for a hybrid, blocks other requests share
    # whose state nobody kept, so a state worth keeping at their end
    num_cached_blocks: int = 0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_snapshots: int = 0,
        windows: Sequence[int | None] = (None,),
        outputs_apart: bool = False,
    ):
        """num_state_slots: a hybrid model's per-sequence state slots (model/kv_cache.py), one per running
        request, taken with its first blocks and given back with them; 0: the model has none. num_snapshots:
        the slots after those that hold state snapshots for the prefix cache. windows: each KV group's (None:
        full attention). outputs_apart: a prompt's tokens are computed with other GEMMs than generated ones
        (ModelRunner.prompt_gemms), so a block holding generated tokens is no prompt's hit: its K/V have other
        bits than the same tokens prefilled."""
        assert num_blocks > 0 and block_size > 0 and windows
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.outputs_apart = outputs_apart
        self.windows = list(windows)
        self.sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self.ref_counts = [0] * num_blocks
        # (KV group, hash) of a cached block, set only on the block the index points to
        self.block_hashes: list[tuple[int, int] | None] = [None] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # blocks 0 .. num_blocks_touched - 1 have been handed out since start, the others never: those never
        # handed out are the free list's tail, in order, taken only once no other block is free
        self.num_blocks_touched = 0
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.hash_to_block: dict[tuple[int, int], int] = {}
        # request id -> chained hashes of its full blocks so far; the parent of the next block is the last one
        self.request_hashes: dict[str, list[int]] = {}
        # in tokens; counted once per request, at its first admission (see allocate)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_state_slots, self.num_snapshots = num_state_slots, num_snapshots
        self.free_state_slots: deque[int] = deque(range(num_state_slots))
        self.uses_state_slots = num_state_slots > 0
        self.free_snapshots: deque[int] = deque(range(num_state_slots, num_state_slots + num_snapshots))
        self.cached_snapshots: OrderedDict[int, int] = OrderedDict()  # slot -> its block's hash, LRU first
        self.hash_to_snapshot: dict[int, int] = {}
        # request id -> (slot, hash) of the snapshot its decoding last took, dropped when it takes the next
        self.decode_snapshots: dict[str, tuple[int, int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: the free ones plus cached ones nobody holds (evictable)."""
        return len(self.free_block_ids) + len(self.cached_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests; cached idle blocks count as free, so idle = 0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached full-block prefix of the request's tokens: every full-attention group's blocks, and
        each sliding group's within its window of the prefix's end (for a hybrid, the longest with a state
        snapshot at its end). No side effects.

        The hit stops one token short of the whole sequence: the model must compute at least one token
        to produce the logits of the next one.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        token_ids = request.all_token_ids
        bs, groups = self.block_size, range(len(self.windows))
        full = [g for g in groups if self.windows[g] is None]
        hashes: list[int] = []
        # per sliding group, the last block up to each one that it has not cached (-1: none)
        last_missing: dict[int, list[int]] = {g: [] for g in self.sliding}
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs], self._generated(request, i))
            if any((g, parent) not in self.hash_to_block for g in full):
                break
            hashes.append(parent)
            for g, missing in last_missing.items():
                cached = (g, parent) in self.hash_to_block
                missing.append(-1 if not missing and cached else missing[-1] if cached else i)
        num_hit = len(hashes)
        while num_hit > 0:
            snapshot_ok = not self.uses_state_slots or hashes[num_hit - 1] in self.hash_to_snapshot
            windows_ok = all(
                last_missing[g][num_hit - 1] < first_block_read(self.windows[g], num_hit * bs, bs)
                for g in self.sliding
            )
            if snapshot_ok and windows_ok:
                break
            num_hit -= 1
        tables = []
        for g in groups:
            first = first_block_read(self.windows[g], num_hit * bs, bs)
            tables.append([BEHIND_WINDOW] * first + [self.hash_to_block[g, h] for h in hashes[first:num_hit]])
        snapshot = self.hash_to_snapshot[hashes[num_hit - 1]] if self.uses_state_slots and num_hit else None
        return PrefixHit(num_hit, tables, hashes[:num_hit], snapshot, len(hashes))

    def allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block tables until they have slots for its first `num_tokens` tokens.

        A prefix hit's blocks (find_cached_prefix) go first, shared; only for a request holding no blocks.
        Returns False, changing nothing, when there are not enough free blocks.
        """
        hit = hit if hit is not None and hit.num_blocks else None
        num_needed = -(-num_tokens // self.block_size)
        if hit is None and request.block_tables and all(len(t) >= num_needed for t in request.block_tables):
            return True  # most decodes: the last block has room
        tables = request.block_tables or [[] for _ in self.windows]
        assert hit is None or not any(tables)
        hit_tables = hit.tables if hit is not None else [[] for _ in self.windows]
        num_new = sum(max(0, num_needed - len(t) - len(h)) for t, h in zip(tables, hit_tables, strict=True))
        # a hit on an idle cached block takes it out of the evictable pool that new blocks come from
        num_revived = sum(1 for h in hit_tables for b in h if b != BEHIND_WINDOW and self.ref_counts[b] == 0)
        if num_new > self.num_free_blocks - num_revived:
            return False
        if self.uses_state_slots and request.state_slot is None:
            if not self.free_state_slots:
                return False
            request.state_slot = self.free_state_slots.popleft()

        # Counted at the first admission only: a recompute after preemption also reuses the cache, but
        # counting it again would make the hit rate reflect memory pressure rather than client traffic.
        if self.enable_prefix_caching and not any(tables) and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += (hit.num_blocks if hit is not None else 0) * self.block_size

        request.block_tables = tables
        for table, cached in zip(tables, hit_tables, strict=True):
            for block_id in cached:
                if block_id != BEHIND_WINDOW:
                    if self.ref_counts[block_id] == 0:
                        del self.cached_block_ids[block_id]
                    self.ref_counts[block_id] += 1
                table.append(block_id)
            while len(table) < num_needed:
                table.append(self._take_block())
        if hit is not None:
            self.request_hashes[request.request_id] = list(hit.hashes)
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
        self.num_blocks_touched = max(self.num_blocks_touched, block_id + 1)
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full of computed tokens (prompt or generated) so that
        later requests can hit them. Call after advancing request.num_computed_tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self.request_hashes.setdefault(request.request_id, [])
        # under async scheduling the computed tokens may end with one drawn by a step still running: not known yet
        known = request.num_prompt_tokens + len(request.output_token_ids)
        num_full = min(request.num_computed_tokens, known) // self.block_size
        if len(hashes) >= num_full:
            return
        token_ids = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT_HASH
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs], self._generated(request, i))
            for g, table in enumerate(request.block_tables):
                block_id = table[i]
                # When another block already holds these tokens (both computed at once), that one stays the
                # cached copy and this one remains anonymous: it returns to the free list when released.
                if block_id != BEHIND_WINDOW and (g, h) not in self.hash_to_block:
                    assert self.block_hashes[block_id] is None
                    self.block_hashes[block_id] = (g, h)
                    self.hash_to_block[g, h] = block_id
            hashes.append(h)

    def _generated(self, request: Request, i: int) -> bool:
        """Whether block i of the request holds generated tokens that its hash must tell apart (outputs_apart)."""
        return self.outputs_apart and (i + 1) * self.block_size > request.num_prompt_tokens

    def release_behind_window(self, request: Request) -> None:
        """Give back the blocks of the request's sliding-window groups that no query from its computed tokens on
        reads (cached, like a finished request's, for a later prefix hit). Call after advancing
        request.num_computed_tokens."""
        for g in self.sliding:
            table = request.block_tables[g]
            i = min(
                first_block_read(self.windows[g], request.num_computed_tokens, self.block_size), len(table)
            )
            while i > 0 and table[i - 1] != BEHIND_WINDOW:  # those before were given back in earlier steps
                i -= 1
                self._release(table[i])
                table[i] = BEHIND_WINDOW

    def take_snapshot(self, request: Request, reuse: bool) -> int | None:
        """A snapshot slot for a copy of the request's state the coming step makes. A decoding request keeps only
        its latest snapshot (a reply's last block boundary is where its chat's next turn resumes; the earlier ones
        would crowd out other requests'): with `reuse` (a copy sure to be cached) it gets its previous one back, if
        still cached. Otherwise a free one, else the least recently used cached one (evicted now: a step reads
        the states it restores before it writes the ones it takes). None when the model keeps no snapshots."""
        previous = self.decode_snapshots.pop(request.request_id, None) if reuse else None
        if previous is not None and self.cached_snapshots.get(previous[0]) == previous[1]:
            del self.cached_snapshots[previous[0]]
            del self.hash_to_snapshot[previous[1]]
            return previous[0]
        if self.free_snapshots:
            return self.free_snapshots.popleft()
        if not self.cached_snapshots:
            return None
        slot, h = self.cached_snapshots.popitem(last=False)
        del self.hash_to_snapshot[h]
        return slot

    def cache_snapshot(self, request: Request, slot: int, num_tokens: int, decoding: bool) -> None:
        """Cache the taken `slot`, now holding the request's state after its first num_tokens tokens (a block
        boundary whose blocks cache_full_blocks indexed)."""
        h = self.request_hashes[request.request_id][num_tokens // self.block_size - 1]
        if h in self.hash_to_snapshot:  # the same state kept already (two requests computed it in one step)
            self.free_snapshots.append(slot)
            return
        self.hash_to_snapshot[h] = slot
        self.cached_snapshots[slot] = h
        if decoding:  # it replaces the request's previous one (where take_snapshot did not reuse that)
            previous = self.decode_snapshots.get(request.request_id)
            if previous is not None and self.cached_snapshots.get(previous[0]) == previous[1]:
                del self.cached_snapshots[previous[0]]
                del self.hash_to_snapshot[previous[1]]
                self.free_snapshots.append(previous[0])
            self.decode_snapshots[request.request_id] = (slot, h)

    def release_snapshot(self, slot: int) -> None:
        """Give back a taken snapshot slot whose copy will not be cached (its request ended first)."""
        self.free_snapshots.append(slot)

    def touch_snapshot(self, slot: int) -> None:
        """A prefix hit used the snapshot: it becomes the most recently used."""
        self.cached_snapshots.move_to_end(slot)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the request's first num_tokens tokens (held for drafts it did not keep:
        never hashed, never shared)."""
        num_needed = -(-num_tokens // self.block_size)
        for table in request.block_tables:
            while len(table) > num_needed:
                block_id = table.pop()
                assert self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None
                self.ref_counts[block_id] = 0
                self.free_block_ids.appendleft(block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail first, so that in the LRU the tail of a prefix is evicted
        before its head (a head block is useful to more future prompts than a tail block)."""
        for table in request.block_tables:
            for block_id in reversed(table):
                if block_id != BEHIND_WINDOW:
                    self._release(block_id)
        request.block_tables = []
        self.request_hashes.pop(request.request_id, None)
        self.decode_snapshots.pop(request.request_id, None)
        if request.state_slot is not None:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None

    def _release(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is None:
                self.free_block_ids.appendleft(block_id)
            else:
                self.cached_block_ids[block_id] = None  # most recently used

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
        assert not set(self.free_snapshots) & set(self.cached_snapshots), "a snapshot both free and cached"
        assert {self.hash_to_snapshot[h]: h for h in self.hash_to_snapshot} == dict(self.cached_snapshots)
