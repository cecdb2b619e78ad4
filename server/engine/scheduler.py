"""Scheduler: which tokens of which requests run in the next step.

Tokens, not phases: a request's `num_computed_tokens` catches up with its `num_tokens` (prompt + output).
A step mixes decodes (1 token) and prefill chunks under one token budget. Each ScheduledChunk says which tokens
of which request run and what the step does with them (draw a token after them, score the prompt tokens, pool
their hidden states). A prefill-only request (PoolingParams: embeddings, scores) is scheduled as any prefill is
(chunked, prefix-cached, under the budget); the output stage finishes it after its last chunk, with no draw.

One step: schedule() (which counts the chunks' tokens as computed and their draws as pending) -> the runner
executes the chunks -> the output stage decides which requests finished (server/engine/output_processor.py) ->
update() appends the drawn tokens and frees the finished requests' blocks. The scheduler never decides why a
request finishes; it frees from that decision. Under async scheduling (engine.py) the next step is scheduled
before this one's update(): a pending draw is then the next decode's input, and a request whose pending draw is
its last is not scheduled again.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from server.engine.block_manager import BlockManager, PrefixHit, blocks_for
from server.engine.config import EngineConfig
from server.engine.request import FinishReason
from server.engine.request_state import Request, RequestStatus
from server.engine.stats import EngineStats


@dataclass(slots=True)
class ScheduledChunk:
    """Compute `request.all_token_ids[start : start + num_tokens - len(drafts)]` followed by `drafts`, at
    positions start.. on."""

    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_tokens: int  # drafts included
    sample: bool  # the chunk reaches the end of the known tokens: the step draws the next token after it
    prompt_logprobs: bool  # also score the prompt tokens it covers (completions' echo with logprobs)
    # a decode's drafts (drafting.py): the step also draws a token after each of them, to verify them
    drafts: list[int] = field(default_factory=list)
    pool: bool = False  # a prefill-only request's chunk: the step returns what its pooling reads
    # a hybrid's state (model/deltanet.py): the snapshot slot it starts from (a prefix hit), and the one the step
    # copies it to after the chunk, which ends at a block boundary (block_manager.py)
    restore_state: int | None = None
    snapshot_to: int | None = None

    @property
    def is_decode(self) -> bool:
        """One new token of a request that is generating, with its drafts (anything else is a prefill chunk)."""
        return (
            self.num_tokens - len(self.drafts) == 1
            and self.sample
            and self.start >= self.request.num_prompt_tokens
        )


def chunk(request: Request, num_tokens: int, drafts: list[int] | None = None) -> ScheduledChunk:
    start = request.num_computed_tokens
    wants_prompt_logprobs = request.params.prompt_logprobs and not request.output_token_ids
    drafts = drafts or []
    pool = request.pooling is not None
    return ScheduledChunk(
        request,
        start,
        num_tokens + len(drafts),
        sample=start + num_tokens == request.num_tokens and not pool,
        pool=pool,
        prompt_logprobs=wants_prompt_logprobs and start < request.num_prompt_tokens,
        drafts=drafts,
    )


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running decodes, running prefills, admitted
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        num_state_slots: int = 0,
        num_snapshots: int = 0,
        windows: tuple[int | None, ...] = (None,),
        outputs_apart: bool = False,
    ):
        """windows: each KV group's (model/config.py's kv_groups); outputs_apart: the block manager's."""
        assert config.max_num_batched_tokens > 0 and config.max_num_seqs > 0
        self.config = config
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            num_state_slots,
            num_snapshots,
            windows,
            outputs_apart,
        )
        # a hybrid with prefix caching: its chunks end at the block boundaries where its state is worth keeping
        self.snapshots = num_snapshots > 0 and config.enable_prefix_caching
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of admitted requests, once per request
        self.num_generation_tokens = 0
        self.num_pooled_requests = 0  # prefill-only requests that finished with their vector
        self.num_steps = 0  # schedule() calls that scheduled something

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here (a message with the numbers), or None if it can."""
        if num_prompt_tokens < 1:
            return "the prompt must contain at least one token"
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len and max_tokens == 0:  # prefill-only
            return (
                f"prompt ({num_prompt_tokens} tokens) exceeds the maximum context length of "
                f"{self.max_model_len} tokens"
            )
        if total > self.max_model_len:
            return (
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"exceeds the maximum context length of {self.max_model_len} tokens"
            )
        # the last sampled token is never fed back, so at most total - 1 tokens need K/V slots (a prefill-only
        # request, max_tokens 0, needs its prompt's)
        num_tokens = num_prompt_tokens + max(max_tokens - 1, 0)
        bm = self.block_manager
        num_blocks = blocks_for(bm.windows, bm.block_size, num_tokens, self.config.max_num_batched_tokens)
        if num_blocks > self.block_manager.num_blocks:
            return (
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {num_blocks} KV-cache "
                f"blocks but the whole cache holds {self.block_manager.num_blocks} "
                f"({self.block_manager.num_blocks * self.config.block_size} tokens)"
            )
        return None

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.ABORT)
        return request

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Finish a waiting or running request now, freeing its blocks and its grammar state; no-op if already
        finished."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.grammar = None
        request.reasoning = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.config.max_num_batched_tokens

        # Running requests in admission order, which puts the decodes first: a request gets a partial chunk
        # only when that chunk uses up the budget, so at most one running request is mid-prefill and it is
        # the newest. Preemption victims come from the end, so none of them was scheduled in this step yet.
        for request in list(self.running):
            budget = token_budget - out.num_batched_tokens
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if self._waits_for_its_end(request):  # it finishes when the step in flight is read back
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            n, keep_state = self._state_boundary(request, request.num_computed_tokens, n)
            drafts = self._fit_drafts(request, n, budget)
            if drafts:
                # a hybrid's state is kept where its drafts end at a block boundary, if they are all kept
                end = request.num_computed_tokens + n + len(drafts)
                keep_state = self.snapshots and end % self.config.block_size == 0
                out.chunks.append(self._with_snapshot(chunk(request, n, drafts), None, keep_state))
                out.num_batched_tokens += n + len(drafts)
            elif self._allocate_or_preempt(request, n, out):
                out.chunks.append(self._with_snapshot(chunk(request, n), None, keep_state))
                out.num_batched_tokens += n

        # Admit waiting requests in order. Not in a step that preempted: the blocks just freed belong to
        # the preempted requests, now at the front of the queue, and re-admitting them at once would thrash.
        now = time.monotonic()
        while self.waiting and not out.preempted and len(self.running) < self.config.max_num_seqs:
            budget = token_budget - out.num_batched_tokens
            if budget == 0:
                break
            request = self.waiting[0]
            hit = (
                PrefixHit()
                if request.reads_every_position
                else self.block_manager.find_cached_prefix(request)
            )
            num_cached = hit.num_blocks * self.config.block_size
            request.num_shared_prefix_tokens = hit.num_cached_blocks * self.config.block_size
            n = min(request.num_tokens - num_cached, budget)
            n, keep_state = self._state_boundary(request, num_cached, n)
            if not self.block_manager.allocate(request, num_cached + n, hit):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a resume after preemption
                request.num_cached_tokens = num_cached
                request.scheduled_time = now
                self.num_prompt_tokens += request.num_prompt_tokens
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._with_snapshot(chunk(request, n), hit.snapshot, keep_state))
            out.num_batched_tokens += n

        # Each chunk's tokens count as computed from now on, and its draw as pending until update() reads it: under
        # async scheduling (engine.py) the next step is scheduled while this one still runs.
        for c in out.chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens - len(c.drafts)
            c.request.num_pending_tokens += c.sample
        if out.chunks:
            self.num_steps += 1
        return out

    def _waits_for_its_end(self, request: Request) -> bool:
        """Whether a running request has nothing left to compute, its end in a step not yet read back (async
        scheduling): a prefill-only request's whole prompt, or a draw that is its last (its max_tokens-th, or at
        the context's end)."""
        if request.num_computed_tokens == request.num_tokens:
            return True
        n = request.num_output_tokens
        return request.num_pending_tokens > 0 and (
            n >= request.params.max_tokens or request.num_prompt_tokens + n >= self.max_model_len
        )

    def _state_boundary(self, request: Request, start: int, n: int) -> tuple[int, bool]:
        """A hybrid's chunk of n tokens from `start`, cut to end at the first block boundary in it where its state
        is worth keeping, and whether the chunk ends at one. Those are where a later request resumes: the end of
        a prefix other requests share (num_shared_prefix_tokens), the last boundary of what it has to prefill
        (a prompt, or a preempted request's tokens so far), and while it decodes, each boundary it reaches (only
        the latest is kept: where a reply ended, its chat's next turn starts). Cut chunks cost a step more."""
        if not self.snapshots:
            return n, False
        bs, end = self.config.block_size, start + n
        if start == request.num_tokens - 1 and request.num_output_tokens:  # a decode
            return n, end % bs == 0
        boundaries = (request.num_shared_prefix_tokens, request.num_tokens // bs * bs)
        for boundary in sorted(boundaries):
            if start < boundary <= end:
                return boundary - start, True
        return n, False

    def _with_snapshot(
        self, c: ScheduledChunk, restore_state: int | None, keep_state: bool
    ) -> ScheduledChunk:
        if restore_state is not None:
            c.restore_state = restore_state
            self.block_manager.touch_snapshot(restore_state)
        if keep_state:  # sure to be cached after a plain decode; after drafts, only if all are kept
            c.snapshot_to = self.block_manager.take_snapshot(c.request, c.is_decode and not c.drafts)
        return c

    def _fit_drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """The drafts a decode can verify this step: what the token budget and the free blocks allow (drafts
        never preempt anyone), with the slots allocated. Empty for a prefill chunk or when none fit."""
        drafts = request.draft_token_ids[: budget - n]
        if self.snapshots:  # a hybrid's drafts end at the next block boundary at most (state kept there)
            drafts = drafts[: -(request.num_computed_tokens + n) % self.config.block_size]
        if n != 1 or not drafts or request.pooling is not None:
            return []
        while drafts and not self.block_manager.allocate(request, request.num_tokens + len(drafts)):
            drafts = drafts[:-1]
        return drafts

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Get slots for n more tokens of a running request, preempting the most recently admitted
        running requests until they fit. False when the request had to preempt itself."""
        while not self.block_manager.allocate(request, request.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: drop the K/V and later recompute prompt + output so far as one long prompt.
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self, out: SchedulerOutput, token_ids: dict[str, list[int]], finished: dict[str, FinishReason]
    ) -> None:
        """Append the tokens the output stage kept for the scheduled requests (request id -> tokens: one, or with
        drafts up to one more than the drafts it confirmed) and finish the requests it ended (request id -> why),
        freeing their blocks. The K/V of a chunk's rejected drafts stays behind num_computed_tokens, unhashed, to be
        overwritten; blocks held only for them are freed. Under async scheduling the next step has been scheduled
        already (its requests' num_computed_tokens are past this step's), and a request may have been preempted
        or aborted since this one was."""
        for c in out.chunks:
            request = c.request
            if request.is_finished:  # aborted since schedule() (the engine applies aborts between steps)
                if c.snapshot_to is not None:
                    self.block_manager.release_snapshot(c.snapshot_to)
                continue
            kept = token_ids.get(request.request_id, [])
            request.output_token_ids.extend(kept)
            request.num_pending_tokens -= c.sample
            self.num_generation_tokens += len(kept)
            # the chunk's known tokens, then the drafts the kept tokens confirmed (all but the last kept)
            computed = c.start + c.num_tokens - len(c.drafts) + max(len(kept) - 1, 0)
            if request.status is RequestStatus.RUNNING:  # not preempted since: it holds its blocks
                if c.drafts:  # schedule() counted its known tokens as computed, no draft
                    request.num_computed_tokens = computed
                    self.block_manager.trim(request, request.num_tokens)
                self.block_manager.cache_full_blocks(request)
                self.block_manager.release_behind_window(request)
                if kept:
                    assert request.num_computed_tokens == request.num_tokens - 1, (
                        "sampled a request mid-prefill"
                    )
            if c.snapshot_to is not None:  # the step copied the state after the chunk there
                end = c.start + c.num_tokens
                # (where a decode had drafts, all of them kept)
                if computed == end and request.status is RequestStatus.RUNNING:
                    self.block_manager.cache_snapshot(request, c.snapshot_to, end, c.is_decode)
                else:
                    self.block_manager.release_snapshot(c.snapshot_to)
            reason = finished.get(request.request_id)  # no token kept: its grammar failed on the draw
            if reason is not None:
                if request.pooling is not None and reason is FinishReason.STOP:
                    self.num_pooled_requests += 1
                self.finish_request(request, reason)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            num_blocks_touched=bm.num_blocks_touched,
            block_size=bm.block_size,
            enable_prefix_caching=bm.enable_prefix_caching,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_pooled_requests=self.num_pooled_requests,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_state_slots=bm.num_state_slots,
            num_state_slots_used=bm.num_state_slots - len(bm.free_state_slots),
            num_snapshots=bm.num_snapshots,
            num_snapshots_cached=len(bm.cached_snapshots),
        )
