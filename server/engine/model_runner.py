"""ModelRunner: a SchedulerOutput in, a ModelOutput out. Owns the model, the KV cache and the attention backend;
keeps nothing per request. server/engine/setup.py builds it, with what the backend (server/engine/backend.py)
chose."""

import time
from dataclasses import dataclass, field

import torch

from model.config import ModelConfig
from model.deltanet import StepStates
from model.device import to_device, to_host
from model.kv_cache import KVCache
from model.sampling import SamplingTensors, row_logsumexp, sample
from model.transformer import Transformer
from server.engine.grammar import fill_bitmasks
from server.engine.request import Pooling, TokenLogprob
from server.engine.request_state import Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.stopping import banned_token_ids


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # when the request asked for logprobs


@dataclass
class ModelOutput:
    """Everything one step computed, by request id."""

    # the token drawn after a chunk; for a decode with drafts, one after its last token and after each draft
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # the logprobs of the prompt tokens a chunk scored (each scores the token after its position)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # what a prefill-only request's chunk gave its pooling (pooled()): the output stage makes the vector of them
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    # a hybrid's decode with drafts: the first of the slots holding its state after each token but the last
    draft_states: dict[str, int] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose forward and draws are queued on the device (on a CPU: done already), until collect() reads it."""

    scheduled: SchedulerOutput
    output: ModelOutput  # what is on the host already: prompt logprobs, pooling, draft state slots; then the draws
    started: float  # time.perf_counter() at its launch
    # each drawn row's request and the drafts before it, and each request's first row
    rows: list[tuple[Request, list[int]]] = field(default_factory=list)
    first_row: dict[str, int] = field(default_factory=dict)
    # [rows] int64 on the device: the next step's decodes read theirs here
    token_ids: torch.Tensor | None = None
    # the draws' copies on the host: token ids, then with logprobs the chosen's, the top ids and their logprobs
    host: list[torch.Tensor] = field(default_factory=list)
    ready: object | None = None  # the device's event recorded after the copies to the host (None on a CPU)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        model_config: ModelConfig,
        kv_cache: KVCache,
        attention,  # the attention backend (model/attention.py): builds each step's metadata
        backend,  # where the ops run (server/engine/backend.py): its device, dtype and sampler kernels
        batch_invariant: bool = False,  # whether a token's logits never depend on what shares its step
        graphs=None,  # decode steps replayed from CUDA graphs (server/engine/decode_graphs.py), or None
        # a prompt's tokens run their GEMMs on the weights dequantized to bfloat16 (the amx tier's tiles), generated
        # ones on the exact weights: each token's bits still depend only on itself (backend.prompt_gemms)
        prompt_gemms: bool = False,
    ):
        self.model, self.model_config, self.kv_cache = model, model_config, kv_cache
        self.attention, self.backend = attention, backend
        self.device, self.dtype = backend.device, backend.dtype
        self.sampler = backend.sampler  # noise and argmax: PyTorch's ops, or the kernels' same bits
        self.batch_invariant = batch_invariant
        self.longrope_original_len = model_config.longrope_original_len  # None unless a layer uses LongRoPE
        self.hybrid = bool(model_config.linear_layers)  # Gated DeltaNet layers: a state slot per sequence
        self.graphs = graphs
        self.prompt_gemms = prompt_gemms
        self.decode_steps = 0  # steps of single-token chunks only, replayed from graphs or not

    @property
    def num_blocks(self) -> int:
        """The blocks requests may hold: the cache's, but for the one the graphs' padded rows write into."""
        return self.kv_cache.num_blocks - (1 if self.graphs is not None else 0)

    def graph_stats(self) -> tuple[int, int]:
        """(decode steps replayed from CUDA graphs, decode steps run eagerly)."""
        replayed = self.graphs.replayed if self.graphs is not None else 0
        return replayed, self.decode_steps - replayed

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """The step run and read back at once."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue the step's forward and draws on the device (on a CPU, run them) and their copy to the host.
        `previous`: the step before, when it has not been read back yet (async scheduling): a decode whose input
        token that step drew reads it on the device, from previous.token_ids."""
        started = time.perf_counter()
        ids: list[int] = []
        starts: list[int] = []  # flat index of each chunk's first token
        # (flat index, the previous step's row) of each input still on the device
        fed: list[tuple[int, int]] = []
        for c in out.chunks:
            starts.append(len(ids))
            end = c.start + c.num_tokens - len(c.drafts)
            known = c.request.token_slice(c.start, end)
            if len(known) < end - c.start:  # a decode of the token the previous step drew
                assert previous is not None and end - c.start == 1, "a chunk past the known tokens"
                fed.append((len(ids), previous.first_row[c.request.request_id]))
                known = [0]
            ids.extend(known)
            ids.extend(c.drafts)
        fed_ids = self._fed_ids(fed, previous) if fed else None
        seq_lens = [c.start + c.num_tokens for c in out.chunks]
        tables = [c.request.block_tables for c in out.chunks]
        decode = bool(out.chunks) and all(c.num_tokens == 1 for c in out.chunks)
        self.decode_steps += decode
        result = ModelOutput()
        state_slots = [c.request.state_slot for c in out.chunks] if self.hybrid else []
        if self.hybrid:  # a prefix hit resumes from the state kept after its blocks
            self._copy_states(
                [(c.restore_state, c.request.state_slot) for c in out.chunks if c.restore_state is not None]
            )
        if decode and self.graphs is not None and self.graphs.bucket(len(ids)) is not None:
            hidden = self.graphs.run(ids, seq_lens, tables, state_slots, fed_ids)
        else:
            hidden = self._forward(out, ids, starts, seq_lens, tables, state_slots, result, fed_ids)
        if self.hybrid:  # states kept at the block boundaries where chunks ended, for later prefix hits
            self._copy_states(
                [(c.request.state_slot, c.snapshot_to) for c in out.chunks if c.snapshot_to is not None]
            )
        return self._launch_outputs(out, starts, hidden, result, started)

    def collect(self, step: "LaunchedStep") -> ModelOutput:
        """The launched step's output, its draws read back (waiting for the device to finish the step)."""
        result = step.output
        if not step.rows:
            return result
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.host[0].tolist()
        logprobs = [None] * len(token_ids)
        if len(step.host) > 1:
            chosen, top_ids, top_lps = (t.tolist() for t in step.host[1:])
            logprobs = [
                TokenLogprob(t, lp, list(zip(ti[: r.params.logprobs], tl[: r.params.logprobs], strict=True)))
                if r.params.logprobs is not None
                else None
                for (r, _), t, lp, ti, tl in zip(step.rows, token_ids, chosen, top_ids, top_lps, strict=True)
            ]
        for (r, _), t, lp in zip(step.rows, token_ids, logprobs, strict=True):
            result.sampled.setdefault(r.request_id, []).append(SampledToken(t, lp))
        return result

    def _fed_ids(
        self, fed: list[tuple[int, int]], previous: "LaunchedStep"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(where in the step's input ids, which ids): the inputs the previous step drew, gathered on the device."""
        where, rows = to_device(torch.tensor(fed, dtype=torch.long).T.contiguous(), self.device)
        return where, previous.token_ids.index_select(0, rows)

    def _forward(self, out: SchedulerOutput, ids: list[int], starts: list[int], seq_lens: list[int],
                 tables: list, state_slots: list[int], result: ModelOutput,
                 fed_ids: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
        """The step's hidden states [T, hidden], its forward run op by op."""
        positions, meta = self.attention.build([c.num_tokens for c in out.chunks], seq_lens, tables)
        input_ids = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        if fed_ids is not None:
            input_ids.index_copy_(0, *fed_ids)
        long_rope = self._long_rope([(c.num_tokens, c.request.num_prompt_tokens + c.request.params.max_tokens)
                                     for c in out.chunks])  # fmt: skip
        states = None
        if self.hybrid:  # a chunk from the prompt's start (or a preempted request's restart) starts from zero
            keep_each = self._draft_state_slots(out.chunks, result)
            states = StepStates(starts, [c.num_tokens for c in out.chunks], state_slots,
                                [c.start for c in out.chunks], keep_each)  # fmt: skip
        prompt_runs = self._prompt_runs(out.chunks, starts) if self.prompt_gemms else None
        return self.model(input_ids, positions, meta, self.kv_cache, long_rope, states, prompt_runs)

    @staticmethod
    def _prompt_runs(chunks: list[ScheduledChunk], starts: list[int]) -> torch.Tensor | None:
        """[R, 2] int64 runs [start, end) of the step's rows that are prompt tokens (a preempted request's
        generated tokens, recomputed, are not), adjacent ones merged; None where there are none."""
        runs: list[list[int]] = []
        for c, s in zip(chunks, starts, strict=True):
            n = min(c.num_tokens, c.request.num_prompt_tokens - c.start)
            if n <= 0:
                continue
            if runs and runs[-1][1] == s:
                runs[-1][1] = s + n
            else:
                runs.append([s, s + n])
        return torch.tensor(runs, dtype=torch.long) if runs else None

    def _launch_outputs(
        self,
        out: SchedulerOutput,
        starts: list[int],
        hidden: torch.Tensor,
        result: ModelOutput,
        started: float,
    ) -> "LaunchedStep":
        """What the step gives from its hidden states [T, hidden]: prompt logprobs and pooling read at once (each
        waits for the device), the draws queued with their copy to the host. A draw after each chunk's last known
        token, and after each of its drafts: row j of a chunk draws as a plain decode would with the output grown by
        its first j drafts (penalties, bans, grammar, position)."""
        for c, start in zip(out.chunks, starts, strict=True):
            if c.prompt_logprobs:
                result.prompt_logprobs[c.request.request_id] = self._prompt_logprobs(hidden, c, start)
            if c.pool and (pooled := self._pooled(hidden[start : start + c.num_tokens], c)) is not None:
                result.pooled[c.request.request_id] = pooled
        step = LaunchedStep(out, result, started)
        chunks, positions = [], []  # the chunks that draw; the flat position of each row's hidden state
        for c, start in zip(out.chunks, starts, strict=True):
            if not c.sample:
                continue
            chunks.append(c)
            step.first_row[c.request.request_id] = len(step.rows)
            # a chunk's last len(drafts) + 1 positions: its last known token, then each draft
            last_known = start + c.num_tokens - 1 - len(c.drafts)
            for j in range(len(c.drafts) + 1):
                step.rows.append((c.request, c.drafts[:j]))
                positions.append(last_known + j)
        if not chunks:
            return step
        logits = self.model.compute_logits(hidden[to_device(torch.tensor(positions), self.device)])
        drawn = sample(logits, self._sampling_tensors(step.rows, chunks), self.sampler)
        step.token_ids = drawn.token_ids.long()
        wanted = [step.token_ids]
        if drawn.top_ids is not None:
            wanted += [drawn.logprobs, drawn.top_ids, drawn.top_logprobs]
        step.host, step.ready = to_host(wanted)
        return step

    def _draft_state_slots(self, chunks: list[ScheduledChunk], result: ModelOutput) -> list[int]:
        """Each chunk's first slot for its state after each token but the last (-1: a chunk without drafts),
        recorded in result.draft_states. The drafter gives a step no more drafts than the cache has slots for."""
        keep_each, free = [], self.kv_cache.first_draft_slot
        for c in chunks:
            keep_each.append(free if c.drafts else -1)
            if c.drafts:
                result.draft_states[c.request.request_id] = free
                free += len(c.drafts)
        assert free <= self.kv_cache.first_draft_slot + self.kv_cache.num_draft_slots, (
            "more drafts than slots"
        )
        return keep_each

    def roll_back_states(self, out: SchedulerOutput, result: ModelOutput, kept: dict[str, list[int]]) -> None:
        """A hybrid's state after a decode with drafts is the state after its last draft. Where the step kept fewer
        (n tokens: its decode's and n - 1 drafts were right), back to the state after the chunk's token n - 1.
        Before the scheduler's update, which gives the slots of finished requests back."""
        pairs = []
        for c in out.chunks:
            first = result.draft_states.get(c.request.request_id)
            num_kept = len(kept.get(c.request.request_id, []))
            if first is not None and 0 < num_kept <= len(c.drafts):
                pairs.append((first + num_kept - 1, c.request.state_slot))
        self._copy_states(pairs)

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs, strict=True)
            self.kv_cache.copy_states(list(src), list(dst))

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk: int) -> torch.Tensor:
        """[n, vocab] float32 logits at every position of one sequence, fed `chunk` tokens at a time through
        the cache's first blocks, each KV group its own (the caller makes sure no request holds them). Every
        token is a prompt's: with prompt_gemms, the GEMMs a prompt runs (what bench-quality then measures)."""
        n = -(-len(token_ids) // self.kv_cache.block_size)
        num_groups = len(self.model_config.kv_groups)
        if n * num_groups > self.num_blocks:
            raise ValueError(f"{len(token_ids)} tokens do not fit in the KV cache")
        tables = [list(range(g * n, (g + 1) * n)) for g in range(num_groups)]
        logits = []
        for start in range(0, len(token_ids), chunk):
            ids = token_ids[start : start + chunk]
            positions, meta = self.attention.build([len(ids)], [start + len(ids)], [tables])
            long_rope = self._long_rope([(len(ids), len(token_ids))])
            # a DeltaNet layer's state in slot 0, which no request holds now
            states = StepStates([0], [len(ids)], [0], [start]) if self.hybrid else None
            input_ids = to_device(torch.tensor(ids), self.device)
            prompt_runs = torch.tensor([[0, len(ids)]]) if self.prompt_gemms else None
            hidden = self.model(input_ids, positions, meta, self.kv_cache, long_rope, states, prompt_runs)
            logits.append(self.model.compute_logits(hidden))
        return torch.cat(logits)

    def _pooled(self, hidden: torch.Tensor, c: ScheduledChunk) -> torch.Tensor | None:
        """What a prefill-only request's chunk gives its vector, from the chunk's hidden states [n, hidden]: the
        last token's (or its logits of the asked-for tokens) when the chunk ends the prompt, the first token's
        when it starts it, or for the mean the sum of every row. float32 on the host; None when the chunk gives
        nothing. Each row is the same bits whatever shares the step (the kernels' rows are batch-invariant); the
        mean's sum is float64, so that how the prompt was chunked hardly moves its float32 result."""
        pooling = c.request.pooling
        if pooling.pooling is Pooling.MEAN:
            return hidden.double().sum(0).cpu()
        if pooling.pooling is Pooling.CLS:
            return hidden[0].float().cpu() if c.start == 0 else None
        if c.start + c.num_tokens < c.request.num_tokens:
            return None
        last = hidden[-1:]  # [1, hidden]
        if not pooling.logit_token_ids:
            return last[0].float().cpu()
        ids = torch.tensor(pooling.logit_token_ids, device=last.device)
        return self.model.compute_logits(last)[0, ids].float().cpu()

    def _long_rope(self, chunks: list[tuple[int, int]]) -> torch.Tensor | None:
        """[T] bool for a LongRoPE model (None otherwise), from each chunk's (tokens, the longest its sequence may
        grow): a sequence that may outgrow the pretraining length takes the long factors from its first token."""
        original = self.longrope_original_len
        if original is None:
            return None
        flags = [longest > original for n, longest in chunks for _ in range(n)]
        return to_device(torch.tensor(flags), self.device)

    def _sampling_tensors(
        self, rows: list[tuple[Request, list[int]]], chunks: list[ScheduledChunk]
    ) -> SamplingTensors:
        """One row per (request, the drafts before it)."""
        reqs = [r for r, _ in rows]
        # a row's mask: its grammar's, or its reasoning's phase's (reasoning.py)
        grammar_rows = [i for i, r in enumerate(reqs) if r.constraint is not None]
        grammar_bitmask = None
        if grammar_rows:
            constrained = [c for c in chunks if c.request.constraint is not None]
            grammar_bitmask = fill_bitmasks(
                [c.request.constraint for c in constrained],
                self.model_config.vocab_size,
                [c.drafts for c in constrained],
            )
        return SamplingTensors.from_lists(
            temperature=[r.params.temperature for r in reqs],
            top_k=[max(r.params.top_k, 0) for r in reqs],
            top_p=[r.params.top_p for r in reqs],
            min_p=[r.params.min_p for r in reqs],
            repetition_penalty=[r.params.repetition_penalty for r in reqs],
            presence_penalty=[r.params.presence_penalty for r in reqs],
            frequency_penalty=[r.params.frequency_penalty for r in reqs],
            seeds=[r.params.seed for r in reqs],  # the engine gives unseeded requests a random seed
            # the output index of the token drawn: the step's own draw is the last pending one
            positions=[r.num_output_tokens - 1 + len(d) for r, d in rows],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids + d if d else r.output_token_ids for r, d in rows],
            suppress_ids=[banned_token_ids(r, r.num_output_tokens - 1 + len(d)) for r, d in rows],
            logit_bias=[r.params.logit_bias for r in reqs],
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
            max_num_logprobs=max(
                (r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None
            ),
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, c: ScheduledChunk, start: int) -> list[TokenLogprob]:
        req = c.request
        # the logits at prompt position p score the prompt token at p + 1
        n = min(c.num_tokens, req.num_prompt_tokens - 1 - c.start)
        if n <= 0:
            return []
        logits = self.model.compute_logits(hidden[start : start + n]).float()
        logp = logits - row_logsumexp(logits)[:, None]  # the same bits however the prompt was chunked
        targets = torch.tensor(req.prompt_token_ids[c.start + 1 : c.start + 1 + n], device=logp.device)
        chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        k = req.params.logprobs or 0
        top_lp, top_id = logp.topk(max(k, 1), dim=-1)
        return [
            TokenLogprob(t, lp, list(zip(ti[:k], tl[:k], strict=True)))
            for t, lp, ti, tl in zip(targets.tolist(), chosen, top_id.tolist(), top_lp.tolist(), strict=True)
        ]
