"""Prometheus metrics with vLLM's names under a ``ferry:`` prefix, fed by the step loop as an
observer the server attaches (``observe``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ferry.engine.async_engine import AsyncEngine
from ferry.engine.live_state import LiveState
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.outputs import RequestOutput
from ferry.engine.step_stats import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


def observe(front: AsyncEngine, model_name: str, replica: str | None = None) -> ServerMetrics:
    """Attach Prometheus metrics (labelled ``replica`` when given) and the dashboard's state to
    ``front``'s step loop, once; returns its metrics."""
    metrics = metrics_of(front)
    if metrics is None:
        metrics = ServerMetrics(front.engine, model_name, replica)
        front.attach(metrics)
        front.attach(LiveState())
    return metrics


def metrics_of(front: AsyncEngine) -> ServerMetrics | None:
    """The metrics ``observe`` attached to ``front``, or None."""
    return next((o for o in front.observers if isinstance(o, ServerMetrics)), None)


class ServerMetrics:
    """Updated from the engine thread after every step, from the step's record (``last_step``)
    and the scheduler's state; read by ``GET /metrics``."""

    def __init__(self, engine: LLMEngine, model_name: str, replica: str | None = None) -> None:
        """``replica``: this engine's index among data-parallel replicas (a ``replica`` label on
        every sample), None for a server of one engine."""
        self.registry = CollectorRegistry()
        labels = ["model_name"] + (["replica"] if replica is not None else [])
        values = [model_name] + ([replica] if replica is not None else [])
        self.label_values = values
        r = self.registry
        state = engine.scheduler.state

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(name, doc, labels, registry=r).labels(*values).set_function(fn)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=r).labels(*values)

        # Spec decoding totals so far, summed from the steps' records.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        gauge("ferry:num_requests_running", "Requests in the running batch.", lambda: state().num_running)
        gauge("ferry:num_requests_waiting", "Requests waiting to be scheduled.", lambda: state().num_waiting)
        gauge("ferry:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", lambda: state().kv_usage)
        gauge("ferry:num_kv_blocks_free", "KV cache blocks free.", lambda: state().num_kv_blocks_free)
        gauge("ferry:spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far (0 without drafts).",
              lambda: self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0)
        gauge("ferry:spec_decode_mean_accepted_length", "Tokens per verify step so far: 1 + accepted drafts "
              "per verify (0 without drafts).",
              lambda: 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)
        self.preemptions = counter("ferry:num_preemptions", "Preemptions (recompute).")
        self.prefix_queries = counter("ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")
        self.drafts = counter("ferry:spec_decode_num_drafts", "Verify steps with drafts (one per request per step).")
        self.draft_tokens = counter("ferry:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("ferry:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
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
        self.encoder_time = hist("ferry:encoder_time_seconds", "Vision encoder time per image encoded.")
        self.encoder_images = counter("ferry:encoder_images", "Images run through the vision encoder.")
        self.encoder_hits = counter("ferry:encoder_cache_hits", "Images whose encoder output was already "
                                    "held (the same image in another request): not encoded again.")

    def _count_step(self, step: StepStats) -> None:
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        for counter, n in ((self.preemptions, step.num_preempted), (self.prefix_queries, step.num_prefix_queried_tokens),
                           (self.prefix_hits, step.num_prefix_hit_tokens), (self.drafts, step.num_drafts),
                           (self.draft_tokens, step.num_draft_tokens), (self.accepted_tokens, step.num_accepted_tokens)):
            if n:
                counter.inc(n)
        for t in step.encoder_seconds:
            self.encoder_time.observe(t)
        if step.encoder_seconds:
            self.encoder_images.inc(len(step.encoder_seconds))
        if step.num_encoder_cache_hits:
            self.encoder_hits.inc(step.num_encoder_cache_hits)

    def on_abort(self, n: int) -> None:
        """Requests aborted by their client (disconnects): they leave without a step output."""
        self.finished.labels(*self.label_values, "abort").inc(n)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called under the engine lock after each step with that step's outputs."""
        step = engine.last_step
        if step is not None:  # None: the step scheduled nothing
            self._count_step(step)
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
