"""The continuous-batching scheduler: who boards this step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running requests
board first, each taking ``min(need, remaining budget)``; that one ``min`` is all
of chunked prefill. Then waiting requests board with whatever budget is left.
When the KV cache runs out of blocks, the last-arrived running request is
preempted (recompute: its blocks go back and its progress resets to 0), and no
new request boards in that step.
"""
from __future__ import annotations

from typing import Callable

from ferry.config import EngineConfig
from ferry.core.kv_cache_manager import KVCacheManager, blocks_for
from ferry.core.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from ferry.core.queues import make_queue
from ferry.core.request import Request, RequestStatus


class Scheduler:
    """Continuous (iteration-level) batching with a token budget."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float]) -> None:
        assert config.max_model_len is not None
        self.config = config
        self.kv = kv
        self.clock = clock
        self.budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []
        self._seq = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Request) -> None:
        """Queue ``req``, or raise ValueError if it could never be served."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n_prompt = req.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
            if max_tokens < 1:
                raise ValueError(f"prompt has {n_prompt} tokens, which leaves no room to generate "
                                 f"within max_model_len ({self.max_model_len})")
        total = n_prompt + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"more than max_model_len ({self.max_model_len})")
        need_blocks = blocks_for(total, self.kv.block_size)
        if need_blocks > self.kv.num_blocks:
            raise ValueError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) needs {need_blocks} KV blocks "
                f"of {self.kv.block_size} tokens, more than the whole cache ({self.kv.num_blocks} blocks)")
        req.max_tokens = max_tokens
        req.seq = self._seq
        self._seq += 1
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop ``request_id`` now and give its blocks back. Unknown ids raise KeyError."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"cannot abort request {request_id!r}: no such unfinished request")
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        req.status = status
        req.times.finished = self.clock()
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_since_last_step.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Decide this step's boarding list."""
        budget = self.budget
        out = SchedulerOutput(finished_req_ids=self._take_finished())
        scheduled: dict[str, int] = {}

        # First priority: keep the running requests moving.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num) is None:
                victim = max(self.running, key=self._victim_key)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[req.request_id] = num
                budget -= num

        # Second priority: board waiting requests with what budget is left,
        # unless this step had to preempt (memory is short; let it drain).
        if not out.preempted_req_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek()
                need = req.num_tokens - req.num_computed_tokens
                if not self.config.enable_chunked_prefill and need > budget:
                    break
                num = min(need, budget)
                if self.kv.allocate_slots(req, num) is None:
                    break
                self.waiting.pop()
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = self.clock()
                    out.new_req_ids.append(req.request_id)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled[req.request_id] = num
                budget -= num

        for req in self.running:
            num = scheduled.get(req.request_id)
            if num:
                out.chunks.append(self._advance(req, num))
        out.num_kv_blocks_used = self.kv.pool.num_used
        return out

    def _advance(self, req: Request, num: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        req.num_computed_tokens += num
        return ScheduledChunk(request=req, start=start, num_tokens=num,
                              block_ids=self.kv.block_tables[req.request_id],
                              samples=req.num_computed_tokens == req.num_tokens)

    def _victim_key(self, req: Request) -> tuple:
        # The last-arrived goes first; under "priority", the least urgent first.
        if self.config.scheduling_policy == "priority":
            return (req.priority, req.arrival_time, req.seq)
        return (req.seq,)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: free blocks, forget progress, back to the queue head."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_recomputed_tokens += req.num_computed_tokens  # work that will be done again
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def _take_finished(self) -> list[str]:
        done, self._finished_since_last_step = self._finished_since_last_step, []
        return done

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, check stop conditions, free finished requests.

        Returns the requests that got a new token or finished in this step.
        """
        now = self.clock()
        changed: list[Request] = []
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished or chunk.padding:
                continue  # aborted while the step ran, or static-batch padding
            rid = req.request_id
            if rid in result.errors:
                req.stop_reason = result.errors[rid]
                self.finish_request(req, RequestStatus.FINISHED_ERROR)
                changed.append(req)
                continue
            if rid in result.prompt_logprobs:
                first, entries = result.prompt_logprobs[rid]
                # A chunk recomputed after preemption scores tokens already recorded: skip those.
                req.prompt_logprobs.extend(entries[len(req.prompt_logprobs) - first:])
            if not chunk.samples:
                continue  # a prefill chunk short of the prompt's end: no token yet
            token = result.sampled[rid]
            req.append_output_token(token)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.token_times.append(now)
            if rid in result.logprobs:
                req.logprobs.append(result.logprobs[rid])
            delta = req.detokenizer.append(token) if req.detokenizer is not None else ""
            req.output_text += delta
            status = self._check_stop(req, token, len(delta))
            if status is not None:
                self.finish_request(req, status)
            changed.append(req)
        return changed

    def _check_stop(self, req: Request, token: int, new_chars: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if token in req.eos_token_ids and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if sp.stop and self._truncate_at_stop_string(req, new_chars):
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _truncate_at_stop_string(req: Request, new_chars: int) -> bool:
        sp = req.sampling_params
        # Only a match that ends in the new text is new: search the new text plus one stop string back.
        window = max(len(s) for s in sp.stop) - 1 + new_chars
        text = req.output_text
        lo = max(0, len(text) - window)
        best = None
        for s in sp.stop:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        req.output_text = text[: i + len(s)] if sp.include_stop_str_in_output else text[:i]
        req.stop_reason = s
        return True
