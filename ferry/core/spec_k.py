"""How many draft tokens each verify carries: the rule that shrinks k under load.

A verify of ``k`` drafts whose tokens are each accepted with chance ``a`` yields on average
``E(k, a) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)`` tokens. It costs the step ``k`` more
target rows and, with a draft model, ``k`` draft steps. Each step, the rule picks every decoding
request's ``k_r`` (0 to its cap) to maximise the step's expected tokens per unit of step time,
``sum_r E(k_r, a_r) / cost``, where ``a_r`` is the request's measured acceptance (an EWMA of its
draft tokens' outcomes) and the cost is a linear model of the step's time measured on the machine
(``StepCost``, piecewise linear). ``k_r = 0`` for every request is no speculation: that wins when the batch is large
enough that extra rows cost more than the tokens they are expected to bring.

Pure Python: the cost model and each request's acceptance. The exact choice over every request's
k (numpy tables) is ``ferry.engine.draft_lengths.choose_ks``, which the engine gives the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify of ``k`` drafts yields on average, each accepted with chance ``a`` (the
    first rejection ends the run; the verify's own sampled token always counts)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


# Step times measured with the engine (2026-12-07, 2 cores of an Intel Xeon with AVX-512 and AMX;
# ``benchmarks/spec_step_cost.py``: medians of whole decode and verify steps), in units of the
# one-row target step (23.7 ms): the float32 SmolLM2-135M target and its Q4_1 GGUF as the draft.
# Target: a step of n rows. Draft: one draft forward step of n requests. Verify: what a step that
# drafts for n requests costs besides those (the draft's catch-up rows, packing, the verifier),
# solved from verify steps of k = 1 and 4 at 1, 4, 16 and 64 requests (the split between the two
# is noisy; their sums are not).
MEASURED_TARGET = ((1, 1.0), (2, 1.169), (4, 1.38), (5, 1.522), (8, 1.777), (16, 2.295), (20, 2.695),
                   (32, 3.462), (64, 6.424), (80, 7.077), (128, 9.547), (192, 11.98), (256, 14.28), (320, 16.738))
# (The draft step over 16 requests came out at 0.341, below the 4-request 0.427: noise of the
# split; kept at 0.427, as a step over more requests is not faster.)
MEASURED_DRAFT = ((1, 0.209), (4, 0.427), (16, 0.427), (64, 2.144))
MEASURED_VERIFY = ((1, 0.31), (4, 0.406), (16, 1.246), (64, 1.614))
Points = tuple[tuple[float, float], ...]


def _points(value: object, name: str) -> Points:
    """(rows, time) pairs, sorted, checked."""
    try:
        pts = tuple(sorted((float(r), float(t)) for r, t in value))  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"speculative_config.step_cost.{name} must be a list of [rows, time] pairs, "
                         f"got {value!r}") from None
    if not pts or any(not (r >= 1 and 0 <= t < float("inf")) for r, t in pts) or len({r for r, _ in pts}) < len(pts):
        raise ValueError(f"speculative_config.step_cost.{name} needs [rows >= 1, time >= 0] pairs with "
                         f"distinct rows, got {value!r}")
    if any(t1 < t0 for (_, t0), (_, t1) in zip(pts, pts[1:])):
        raise ValueError(f"speculative_config.step_cost.{name}: a step of more rows cannot take less time, "
                         f"got {value!r}")
    return pts


def _at(points: Points, rows: float) -> float:
    """Piecewise-linear time at ``rows``: proportional to the first point's below it, the last
    segment's slope past the last (constant past a single point)."""
    r0, t0 = points[0]
    if rows < r0:
        return t0 * rows / r0
    for (ra, ta), (rb, tb) in zip(points, points[1:]):
        if rows <= rb:
            return ta + (tb - ta) / (rb - ra) * (rows - ra)
    if len(points) == 1:
        return t0
    (ra, ta), (rb, tb) = points[-2], points[-1]
    return tb + (tb - ta) / (rb - ra) * (rows - rb)


@dataclass(frozen=True)
class StepCost:
    """A step's time from measured step times (``(rows, time)`` points, linear between them):
    ``target`` for the target's step of ``rows`` rows; ``draft`` for one draft forward step over
    ``rows`` requests; ``verify`` for the rest a step that drafts for ``rows`` requests costs
    (catch-up, packing, the verifier); n-gram lookup has neither of the last two. Only ratios
    matter. The defaults were measured here (``MEASURED_*``); measure yours with
    ``benchmarks/spec_step_cost.py`` and set them in
    ``speculative_config.step_cost`` as ``{"target": [[rows, time], ...], "draft": [...],
    "verify": [...]}``."""

    target: Points = MEASURED_TARGET
    draft: Points = MEASURED_DRAFT
    verify: Points = MEASURED_VERIFY

    def __post_init__(self) -> None:
        for name in ("target", "draft", "verify"):
            object.__setattr__(self, name, _points(getattr(self, name), name))
        if any(t <= 0 for _, t in self.target):
            raise ValueError(f"speculative_config.step_cost.target needs times > 0 (a step takes time), "
                             f"got {self.target!r}")

    @classmethod
    def parse(cls, value: "StepCost | Mapping[str, object] | None", drafts_free: bool) -> "StepCost":
        """From ``speculative_config.step_cost`` (a dict of some of the fields); None: the defaults,
        with free draft steps when ``drafts_free`` (n-gram lookup)."""
        if isinstance(value, StepCost):
            return value
        free = ((1, 0.0),)
        base = {"target": MEASURED_TARGET, "draft": free if drafts_free else MEASURED_DRAFT,
                "verify": free if drafts_free else MEASURED_VERIFY}
        if value is None:
            return cls(**base)
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config.step_cost must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(base))
        if unknown:
            raise ValueError(f"speculative_config.step_cost: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(base))}")
        return cls(**{**base, **value})

    def of(self, rows: int, ks: Sequence[int]) -> float:
        """The step's cost: ``rows`` target rows besides the drafts, and a draft of ``ks[r]`` tokens
        for each request (draft step j runs the requests with ``k_r >= j``)."""
        total, drafting = sum(ks), sum(1 for k in ks if k > 0)
        steps = sum(_at(self.draft, sum(1 for k in ks if k >= j)) for j in range(1, max(ks, default=0) + 1))
        return _at(self.target, rows + total) + steps + (_at(self.verify, drafting) if drafting else 0.0)


class AcceptanceTracker:
    """Each request's measured acceptance: an EWMA over its draft tokens' outcomes (accepted 1,
    the first rejected 0; tokens after a rejection were never judged). A new request starts at the
    engine-wide EWMA (``prior`` at first). A request that drafts nothing for a step is measured by
    nothing, so its estimate relaxes toward the engine-wide rate by ``recover`` (a poor request
    drafts again once it looks like the rest and is measured again). Not toward 1: under load an
    optimistic estimate would turn drafting on for the whole batch every few steps, each time
    paying the draft's catch-up over every token since it last ran, a cost the rule does not see."""

    def __init__(self, prior: float = 0.8, weight: float = 0.2, recover: float = 0.05) -> None:
        if not (0 <= prior <= 1 and 0 < weight <= 1 and 0 <= recover <= 1):
            raise ValueError("prior in [0, 1], weight in (0, 1], recover in [0, 1]")
        self.overall = prior
        self.weight, self.recover = weight, recover
        self.rates: dict[str, float] = {}

    def rate(self, request_id: str) -> float:
        """The request's acceptance estimate."""
        return self.rates.get(request_id, self.overall)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify of ``num_drafts`` tokens of which the first ``num_accepted`` were accepted."""
        if num_drafts <= 0:
            return
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafts else [])
        a, w = self.rate(request_id), self.weight
        for x in outcomes:
            a += w * (x - a)
            self.overall += w * 0.25 * (x - self.overall)  # the engine-wide rate moves more slowly
        self.rates[request_id] = a

    def idle(self, request_id: str) -> None:
        """The request drafted nothing this step: its estimate relaxes toward the engine-wide rate."""
        a = self.rate(request_id)
        self.rates[request_id] = a + self.recover * (self.overall - a)

    def forget(self, request_id: str) -> None:
        self.rates.pop(request_id, None)
