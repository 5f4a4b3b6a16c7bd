"""The static-batching baseline, on the same engine, for honest comparison.

A batch of up to B (= ``max_num_seqs``) requests boards together; their prompts
are prefilled together in one step and their KV blocks are reserved for the
worst case (prompt + max_tokens), as a padded static batch holds its memory.
A request that finishes early keeps its slot: every later step recomputes its
last token (real work, result discarded) until the whole batch is done. Those
slot-steps are static batching's waste (what Orca's iteration-level scheduling
removes), counted as padding tokens.
It never reuses cached prefixes nor speculates: it is the baseline without them.
"""
from __future__ import annotations

from ferry.core.outputs import ScheduledChunk, SchedulerOutput
from ferry.core.request import Request, RequestStatus
from ferry.core.scheduler import Scheduler


class StaticScheduler(Scheduler):
    """Run-to-completion batches: a new batch starts only when the whole last one has ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._take_finished())
        if not self.batch:
            self._admit_batch(out)
        self._in_flight = {}
        for req in self.batch:
            if req.is_finished:  # padding: recompute the last computed token, discard it
                out.chunks.append(ScheduledChunk(
                    request_id=req.request_id, start=req.num_computed_tokens - 1, num_tokens=1,
                    new_block_ids=[], samples=False, padding=True))
        self._advance(self.batch, {r.request_id: r.num_tokens - r.num_computed_tokens
                                   for r in self.batch if not r.is_finished}, out)
        out.num_kv_blocks_used = self.kv.pool.num_used
        return out

    def _admit_batch(self, out: SchedulerOutput) -> None:
        while self.waiting and len(self.batch) < self.max_num_seqs:
            req = self.waiting.peek()
            # Reserve the worst case up front; the last sampled token is never computed.
            if self.kv.allocate_slots(req, req.num_prompt_tokens + req.max_tokens - 1) is None:
                break
            self.waiting.pop()
            req.times.first_scheduled = self.clock()
            req.status = RequestStatus.RUNNING
            out.new_requests.append(self._new_request(req))
            self.running.append(req)
            self.batch.append(req)

    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if status is RequestStatus.FINISHED_ABORTED or req not in self.batch:
            if req in self.batch:
                self.batch.remove(req)
            super().finish_request(req, status, stop_reason)
        else:
            # Finished inside a batch: done for the user, but its slot (and blocks, and the
            # executor's state for the padding steps) stay until the batch ends.
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self.running.remove(req)
            req.status = status
            req.times.finished = self.clock()
            del self.requests[req.request_id]
        # Checked on every finish, aborts included: an abort can end a batch whose others are done.
        if self.batch and all(r.is_finished for r in self.batch):
            for r in self.batch:
                self.kv.free(r)
                self._finished_since_last_step.append(r.request_id)
            self.batch = []
