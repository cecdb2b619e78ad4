"""The output stage of a step: what the runner computed in, one delta per request out, and who finished why.

Per request it keeps the text so far (an incremental detokenizer, plus text held back while it may begin a
stop string), the prompt logprobs not yet sent and when the first token came. Whether a token ends the output
is stopping.py's answer; a stop string in the text wins over it (the text is here). The scheduler frees the
finished requests' blocks from what this stage says. A request under a grammar has its grammar state advanced
here, by the token drawn; a grammar that fails midway ends its request with an error for the client. A
prefill-only request gathers what its chunks gave its pooling, and its prompt's last chunk finishes it with its
vector.
"""

import time
from dataclasses import dataclass

import torch

from model.tokenizer import IncrementalDetokenizer, Tokenizer
from server.engine.model_runner import ModelOutput, SampledToken
from server.engine.request import (
    FinishReason,
    Pooling,
    RequestError,
    RequestOutput,
    RequestTimes,
    TokenLogprob,
)
from server.engine.request_state import Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.stopping import finish_reason, makes_tool_calls


@dataclass(slots=True)
class RequestState:
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    markers: frozenset[int] = frozenset()  # SamplingParams.marker_token_ids: left out of the text, marked
    held: str = ""  # text not yet sent: it may be the start of a stop string
    # the prompt's logprobs by position, filled over its chunks (a preempted prefill recomputes some: they land
    # in the same places) until the first output carries them; None = not asked for, or sent
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    # a prefill-only request's pooling so far: the sum of its chunks' rows (mean), or the row it pools
    pooled: torch.Tensor | None = None

    def release(self, new_text: str, final: bool) -> tuple[str, str | None]:
        """(text that can be sent now, the stop string that ended the output or None)."""
        text = self.held + new_text
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.held = ""
            return text[: i + len(s)] if self.include_stop else text[:i], s
        keep = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        keep = min(keep, len(text))
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


def grammar_failure(request: Request, num_output_tokens: int) -> RequestError:
    why = request.grammar.failure
    return RequestError(
        f"the output's grammar failed after {num_output_tokens} tokens: {why} (a simpler JSON schema or "
        "grammar needs less work per token)",
        by_request=True,
    )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request) -> None:
        params = request.params
        self.states[request.request_id] = RequestState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            [] if makes_tool_calls(params.grammar) else params.stop,
            params.include_stop_str_in_output,
            params.marker_token_ids,
            # the first prompt token has none: nothing comes before it
            prompt_logprobs=[None] * request.num_prompt_tokens if params.prompt_logprobs else None,
        )

    def process(
        self, out: SchedulerOutput, model_output: ModelOutput
    ) -> tuple[list[RequestOutput], dict[str, FinishReason]]:
        """The step's deltas, and the requests it finished (request id -> why)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        finished: dict[str, FinishReason] = {}
        for c in out.chunks:
            request = c.request
            if request.is_finished:  # under async scheduling: aborted, or finished by the step before
                continue
            state = self.states[request.request_id]
            scored = model_output.prompt_logprobs.get(request.request_id)
            if scored is not None and state.prompt_logprobs is not None:
                # the logits at position p score the prompt token at p + 1
                state.prompt_logprobs[c.start + 1 : c.start + 1 + len(scored)] = scored
            if c.pool:
                output = self._pool(c, state, model_output.pooled.get(request.request_id), now)
                if output is not None:
                    finished[request.request_id] = output.finish_reason
                    outputs.append(output)
                continue
            sampled = model_output.sampled.get(request.request_id)
            if sampled is None:
                continue
            kept, text, marks, reason, stop_string = self._keep(request, state, sampled, c.drafts)
            if state.first_token_time is None:
                state.first_token_time = now
            output = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[s.token_id for s in kept],
                text=text,
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=len(request.output_token_ids) + len(kept),  # update() appends them
                num_cached_tokens=request.num_cached_tokens,
                logprobs=[s.logprob for s in kept] if request.params.logprobs is not None else None,
                prompt_logprobs=state.take_prompt_logprobs(),
                stop_string=stop_string,
                marks=marks,
            )
            if reason is FinishReason.ABORT:
                output.error = grammar_failure(request, output.num_output_tokens)
            if reason is not None:
                finished[request.request_id] = reason
                output.times = self._times(request, state, now)
                del self.states[request.request_id]
            outputs.append(output)
        return outputs, finished

    def _pool(
        self, c: ScheduledChunk, state: RequestState, part: torch.Tensor | None, now: float
    ) -> RequestOutput | None:
        """Gather what a prefill-only request's chunk gave its pooling; after the prompt's last chunk, its one
        output, finished, with the vector."""
        request = c.request
        mean = request.pooling.pooling is Pooling.MEAN
        if part is not None:
            # a chunk from position 0 starts over (a preempted request recomputes its prompt: mean pooling never
            # takes cached blocks, so it always restarts there)
            state.pooled = state.pooled + part if mean and c.start > 0 else part
        if c.start + c.num_tokens < request.num_tokens:
            return None
        vector = state.pooled / request.num_prompt_tokens if mean else state.pooled
        state.first_token_time = now
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            text="",
            finished=True,
            finish_reason=FinishReason.STOP,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            pooled=vector.float().tolist(),
            times=self._times(request, state, now),
        )
        del self.states[request.request_id]
        return output

    def _keep(
        self, request: Request, state: RequestState, sampled: list[SampledToken], drafts: list[int]
    ) -> tuple[list[SampledToken], str, list[tuple[int, int]], FinishReason | None, str | None]:
        """The drawn tokens the output keeps, in order, as the plain path would have drawn them one per step:
        each draw after a confirmed draft is what that step would have drawn, so keep draws while each equals
        the draft it follows, and stop at the first that ends the output. Returns (kept, their text, where the
        marker tokens fell in it, why the output ended or None, the stop string that ended it or None). A token
        the grammar refuses is not kept and ends the output with ABORT: the mask allows only what the grammar
        takes, so the grammar itself failed (llguidance's per-token budget ran out while masking or advancing;
        then its mask allows only the end). A token that moves the request's reasoning to another phase ends the
        run too: the draws after it were masked as the phase before it masks."""
        kept: list[SampledToken] = []
        texts: list[str] = []
        marks: list[tuple[int, int]] = []
        num_chars = 0
        reason = stop_string = None
        for j, drawn in enumerate(sampled):
            token_id = drawn.token_id
            moved = False
            if request.reasoning is not None:
                phase = request.reasoning.phase
                over, answers = request.reasoning.advance(token_id)
                moved = over or request.reasoning.phase is not phase
                if over:  # the answer starts: under the grammar, from its first token
                    request.grammar, request.reasoning = request.reasoning.grammar, None
                    if answers and request.grammar is not None and not request.grammar.accept(token_id):
                        reason = FinishReason.ABORT
                        break
            elif request.grammar is not None and not request.grammar.accept(token_id):
                reason = FinishReason.ABORT
                break
            kept.append(drawn)
            num_output = len(request.output_token_ids) + len(kept)
            reason = finish_reason(request, token_id, num_output, self.max_model_len)
            marker = token_id in state.markers
            if marker:  # not in the text: what is held back goes before it
                new_text = state.detokenizer.flush()
            else:
                new_text = state.detokenizer.add([token_id])
                if reason is not None:
                    new_text += state.detokenizer.flush()
            text, stop_string = state.release(new_text, final=reason is not None or marker)
            texts.append(text)
            num_chars += len(text)
            if stop_string is not None:
                reason = FinishReason.STOP
            elif marker:
                marks.append((num_chars, token_id))
            if reason is not None or moved or j == len(drafts) or token_id != drafts[j]:
                break
        return kept, "".join(texts), marks, reason, stop_string

    def abort(self, request: Request) -> RequestOutput:
        """The last output of a request ended before it finished (client gone, shutdown, engine error)."""
        state = self.states.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            text="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=state.take_prompt_logprobs() if state else None,
            times=self._times(request, state, time.monotonic()),
        )

    @staticmethod
    def _times(request: Request, state: RequestState | None, now: float) -> RequestTimes:
        first = state.first_token_time if state else None
        return RequestTimes(request.arrival_time, request.scheduled_time, first, now)
