"""Prometheus metrics with vLLM's names under a ``ferry:`` prefix."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ferry.engine.llm_engine import LLMEngine
from ferry.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """Updated from the engine thread after every step; read by ``GET /metrics``."""

    def __init__(self, engine: LLMEngine, model_name: str, replica: str | None = None) -> None:
        """``replica``: this engine's index among data-parallel replicas (a ``replica`` label on
        every sample), None for a server of one engine."""
        self.registry = CollectorRegistry()
        labels = ["model_name"] + (["replica"] if replica is not None else [])
        values = [model_name] + ([replica] if replica is not None else [])
        self.label_values = values
        r = self.registry
        sched = engine.scheduler

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(name, doc, labels, registry=r).labels(*values).set_function(fn)

        gauge("ferry:num_requests_running", "Requests in the running batch.", lambda: sched.num_running)
        gauge("ferry:num_requests_waiting", "Requests waiting to be scheduled.", lambda: sched.num_waiting)
        gauge("ferry:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
              lambda: engine.kv.pool.num_used / engine.num_kv_blocks)
        gauge("ferry:num_kv_blocks_free", "KV cache blocks free.", lambda: engine.kv.pool.num_free)
        gauge("ferry:spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far (0 without drafts).",
              lambda: sched.num_accepted_tokens / sched.num_draft_tokens if sched.num_draft_tokens else 0.0)
        gauge("ferry:spec_decode_mean_accepted_length", "Tokens per verify step so far: 1 + accepted drafts "
              "per verify (0 without drafts).",
              lambda: 1 + sched.num_accepted_tokens / sched.num_drafts if sched.num_drafts else 0.0)
        self.preemptions = Counter("ferry:num_preemptions", "Preemptions (recompute).", labels, registry=r).labels(*values)

        def engine_counter(name: str, doc: str, read) -> None:
            # The engine counts; each step adds what it counted since the last one.
            self._counters.append((Counter(name, doc, labels, registry=r).labels(*values), read, [read()]))

        self._counters: list = []
        engine_counter("ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       lambda: engine.kv.num_queried_tokens)
        engine_counter("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).",
                       lambda: engine.kv.num_hit_tokens)
        engine_counter("ferry:spec_decode_num_drafts", "Verify steps with drafts (one per request per step).",
                       lambda: sched.num_drafts)
        engine_counter("ferry:spec_decode_num_draft_tokens", "Draft tokens proposed.", lambda: sched.num_draft_tokens)
        engine_counter("ferry:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                       lambda: sched.num_accepted_tokens)
        self.prompt_tokens = Counter("ferry:prompt_tokens", "Prefilled prompt tokens.", labels, registry=r).labels(*values)
        self.generation_tokens = Counter("ferry:generation_tokens", "Generated tokens.", labels, registry=r).labels(*values)
        self.finished = Counter("ferry:request_success", "Finished requests by reason.", labels + ["finished_reason"],
                                registry=r)
        self.failures = Counter("ferry:request_failures", "Requests failed by an error in their step (the "
                                "other requests of that step are retried without them).", labels,
                                registry=r).labels(*values)

        def hist(name: str, doc: str):
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(*values)

        self.ttft = hist("ferry:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("ferry:inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("ferry:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("ferry:request_queue_time_seconds", "Arrival to first scheduled.")
        self._seen_preemptions = engine.num_preemptions

    def on_abort(self, n: int) -> None:
        """Requests aborted by their client (disconnects): they leave without a step output."""
        self.finished.labels(*self.label_values, "abort").inc(n)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called under the engine lock after each step with that step's outputs."""
        n = engine.num_preemptions
        if n > self._seen_preemptions:
            self.preemptions.inc(n - self._seen_preemptions)
            self._seen_preemptions = n
        for counter, read, seen in self._counters:
            now = read()
            if now > seen[0]:
                counter.inc(now - seen[0])
            seen[0] = now  # a reset engine counter starts again from there
        for out in outputs:
            m, comp = out.metrics, out.outputs[0]
            assert m is not None
            # A step's output carries its new tokens (several with speculation), unless it failed.
            if comp.finish_reason != "error":
                new = out.num_new_tokens
                self.generation_tokens.inc(new)
                first = len(comp.token_ids) - new  # tokens before this step
                if first == 0 and new:
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self.ttft.observe(m.ttft)
                    self.queue.observe(m.queue_time)
                t = m.token_times
                for i in range(max(first, 1), len(t)):
                    self.itl.observe(t[i] - t[i - 1])
            else:
                self.failures.inc()
            if out.finished:
                self.finished.labels(*self.label_values, comp.finish_reason or "unknown").inc()
                self.e2e.observe(m.e2e)
