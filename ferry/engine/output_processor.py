"""The frontend side of a request: text, stop strings, logprobs and the outputs users see.

The scheduler owns token ids and token-level stops (EOS, stop token ids, max_tokens). Right
after its update each step, this takes the new tokens of every changed request, detokenizes
them, looks for stop strings (reporting the requests they stop, which the engine finishes),
files logprobs, and builds one ``RequestOutput`` per request, whose text holds back what could
still turn out to be the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ferry.core.outputs import ModelRunnerOutput
from ferry.core.request import Request, RequestStatus
from ferry.core.sampling_params import SamplingParams
from ferry.engine.detokenizer import IncrementalDetokenizer
from ferry.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    """What the user sees of one request so far."""

    prompt: str | None
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    num_tokens: int = 0  # output tokens taken in: with a stop string mid-step, fewer than generated
    num_shown: int = 0  # output tokens in the last RequestOutput built
    num_chars_shown: int = 0  # characters of text in it
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # One entry per prompt token once prefilled, when asked for; the first token has none.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    stop_string: str | None = None
    # No text, no stop strings, no logprobs: the tokens need no look (token-id runs, the simulator).
    passthrough: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, req: Request, prompt: str | None) -> None:
        sp = req.sampling_params
        self.states[req.request_id] = RequestState(
            prompt=prompt, sampling_params=sp,
            detokenizer=IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
            if self.tokenizer is not None else None,
            prompt_logprobs=[None] if sp.prompt_logprobs is not None else [],
            passthrough=self.tokenizer is None and not sp.stop and sp.logprobs is None)

    def take(self, changed: list[Request], result: ModelRunnerOutput) -> list[tuple[Request, str]]:
        """Take in one step's tokens and logprobs; returns the requests a stop string ended, with
        it (for the engine to finish: their later tokens are not shown)."""
        for rid, (first, entries) in result.prompt_logprobs.items():
            st = self.states.get(rid)
            if st is not None:
                # A chunk recomputed after preemption scores tokens already recorded: skip those.
                st.prompt_logprobs.extend(entries[len(st.prompt_logprobs) - first:])
        stopped = []
        for req in changed:
            st = self.states[req.request_id]
            # A passthrough state takes its tokens in when its output is built.
            if not st.passthrough and self._take_tokens(req, st, result.logprobs.get(req.request_id)):
                stopped.append((req, st.stop_string))
        return stopped

    def outputs(self, changed: list[Request], finished_only: bool = False) -> list[RequestOutput]:
        """Outputs for the changed requests (only finished ones with ``finished_only``)."""
        return [self.output(req) for req in changed if req.status.finished or not finished_only]

    def _take_tokens(self, req: Request, st: RequestState, logprobs: list[dict[int, float]] | None) -> bool:
        sp = st.sampling_params
        new = req.output_token_ids[st.num_tokens:]
        for i, token in enumerate(new):
            st.num_tokens += 1
            if logprobs is not None:
                st.logprobs.append(logprobs[i])
            delta = st.detokenizer.append(token) if st.detokenizer is not None else ""
            st.text += delta
            # A token that stopped the request (EOS, a stop token id) is not searched for stop strings.
            stopped_by_token = i == len(new) - 1 and req.status is RequestStatus.FINISHED_STOPPED
            if sp.stop and st.num_tokens >= sp.min_tokens and not stopped_by_token \
                    and self._truncate_at_stop_string(st, len(delta)):
                return True  # tokens after the stop (accepted drafts of the same step) are not shown
        return False

    @staticmethod
    def _truncate_at_stop_string(st: RequestState, new_chars: int) -> bool:
        """Cut the text at the first stop string that ends in the newest text; sets no status."""
        sp = st.sampling_params
        # Only a match that ends in the new text is new: search the new text plus one stop string back.
        window = max(len(s) for s in sp.stop) - 1 + new_chars
        text = st.text
        lo = max(0, len(text) - window)
        best = None
        for s in sp.stop:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        st.text = text[: i + len(s)] if sp.include_stop_str_in_output else text[:i]
        st.stop_string = s
        return True

    @staticmethod
    def _visible(st: RequestState, finished: bool) -> str:
        """The text to show: with stop strings, all but the tail that could be the start of one
        (it may be cut when the rest arrives); never less than shown before."""
        stop = st.sampling_params.stop
        if finished or not stop:
            st.num_chars_shown = len(st.text)
        else:
            st.num_chars_shown = max(st.num_chars_shown, len(st.text) - (max(map(len, stop)) - 1))
        return st.text[:st.num_chars_shown]

    def output(self, req: Request) -> RequestOutput:
        """The request's output as of now; a finished request's state is dropped."""
        st = self.states[req.request_id]
        if req.is_finished:
            del self.states[req.request_id]
        if st.passthrough:
            st.num_tokens = len(req.output_token_ids)
        t, sp, n = req.times, st.sampling_params, st.num_tokens
        num_new_tokens, st.num_shown = n - st.num_shown, n
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(
                index=0, text=self._visible(st, req.is_finished), token_ids=req.output_token_ids[:n],
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                logprobs=list(st.logprobs) if sp.logprobs is not None else None)],
            finished=req.is_finished,
            # Only with the first token and the last output: a long prompt's list is not copied every step.
            prompt_logprobs=list(st.prompt_logprobs) if sp.prompt_logprobs is not None
            and (n <= num_new_tokens or req.is_finished) else None,
            metrics=RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished,
                                   t.token_times[:n], req.num_preemptions, req.num_recomputed_tokens,
                                   req.num_cached_tokens),
            num_new_tokens=num_new_tokens,
            embedding=req.embedding,
        )
