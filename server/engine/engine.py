"""Engine: the synchronous core. add_request / abort / step(), each step = schedule -> run -> update -> text."""

import dataclasses
import logging
import random
from dataclasses import dataclass

from model.tokenizer import IncrementalDetokenizer, Tokenizer
from server.engine.config import EngineConfig
from server.engine.model_runner import ModelRunner, Sampled
from server.engine.request import FinishReason, Request, RequestOutput, RequestTimes, SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TextState:
    """Per-request text: the detokenizer, plus text held back because it may begin a stop string."""

    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    held: str = ""

    def release(self, new_text: str, final: bool) -> tuple[str, bool]:
        """(text that can be sent now, whether a stop string ended the output)."""
        text = self.held + new_text
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.held = ""
            return text[: i + len(s)] if self.include_stop else text[:i], True
        keep = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        keep = min(keep, len(text))
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False


class Engine:
    def __init__(self, model_path: str, config: EngineConfig, chat_template: str | None = None):
        self.config = config
        self.runner = ModelRunner(model_path, config)
        self.model_config = self.runner.model_config
        self.tokenizer = Tokenizer.from_dir(model_path, chat_template)
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len)
        # stop tokens: the union of config.json, generation_config.json and the tokenizer's EOS
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids
        )
        self.vocab_size = self.model_config.vocab_size
        self.texts: dict[str, TextState] = {}

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (shown to the client) when the request can never be served."""
        params.validate(self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        error = self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)
        if error:
            raise ValueError(error)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.texts:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if params.seed is None:  # a fixed seed per request keeps its draws independent of the batch
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        self.texts[request_id] = TextState(
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            params.stop,
            params.include_stop_str_in_output,
        )
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        self.texts.pop(request_id, None)
        self.runner.take_prompt_logprobs(request_id)
        if request is None:
            return None
        return self._output(request, [], "", None)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out)
        finished = {
            r.request_id for r in self.scheduler.update(out, {k: s.token_id for k, s in sampled.items()})
        }
        outputs = []
        for request, _ in out.scheduled:
            s = sampled.get(request.request_id)
            if s is not None and request.request_id in self.texts:
                outputs.append(self._process_token(request, s, request.request_id in finished))
        return outputs

    def _process_token(self, request: Request, s: Sampled, finished: bool) -> RequestOutput:
        state = self.texts[request.request_id]
        new_text = state.detokenizer.add([s.token_id])
        if finished:
            new_text += state.detokenizer.flush()
        text, stopped = state.release(new_text, final=finished)
        if stopped and not finished:
            self.scheduler.finish_request(request, FinishReason.STOP)
        if stopped:
            request.finish_reason = FinishReason.STOP
        return self._output(request, [s.token_id], text, s.logprob)

    def _output(self, request: Request, new_ids: list[int], text: str, logprob) -> RequestOutput:
        done = request.is_finished
        first = len(request.output_token_ids) <= 1
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            text=text,
            finished=done,
            finish_reason=request.finish_reason if done else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            logprobs=[logprob] if logprob is not None else None,
            prompt_logprobs=self.runner.take_prompt_logprobs(request.request_id) if first or done else None,
        )
        if done:
            self.texts.pop(request.request_id, None)
            output.times = RequestTimes(
                request.arrival_time, request.scheduled_time, request.first_token_time, request.finish_time
            )
        return output

    def stats(self) -> EngineStats:
        return self.scheduler.stats()
