"""The exact draft-length choice of ``adaptive_k`` (``ferry.core.spec_k`` states the rule and
its cost model): each step, every decoding request's ``k`` maximising the step's expected tokens per
unit of step time. numpy tables, so it lives outside the pure-Python core; the engine hands it to
the scheduler."""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from ferry.core.spec_k import Points, StepCost, _at, expected_tokens


def _at_many(points: Points, rows: np.ndarray) -> np.ndarray:
    """``ferry.core.spec_k._at`` at each of ``rows``."""
    r = np.array([p[0] for p in points])
    t = np.array([p[1] for p in points])
    rows = np.asarray(rows, dtype=np.float64)
    out = np.interp(rows, r, t)
    if len(points) > 1:
        slope = (t[-1] - t[-2]) / (r[-1] - r[-2])
        out = np.where(rows > r[-1], t[-1] + slope * (rows - r[-1]), out)
    return np.where(rows < r[0], t[0] * rows / r[0], out)


def choose_ks(acceptance: Sequence[float], caps: Sequence[int], cost: StepCost, other_rows: int = 0
              ) -> list[int]:
    """Each decoding request's draft length: the ``k_r`` in ``[0, caps[r]]`` maximising
    ``(other_rows + sum_r E(k_r, a_r)) / cost.of(other_rows + n, ks)`` over every choice (exact).

    Dinkelbach's method turns the ratio into a few maximisations of ``tokens - lam * cost``
    (``lam`` the best ratio so far, raised until nothing beats it). Each is exact by dynamic
    programming over the draft steps: among requests of one cap, a better acceptance never drafts
    fewer tokens (swapping two lengths gains ``sum_j (a_hi^j - a_lo^j) >= 0`` at equal cost), so the
    choices of one cap group are described by the counts ``n_1 >= n_2 >= ...`` drafting at each
    step, and the DP runs over (step, count, drafts so far) for the group with the most choices.
    The other groups (requests near their ends have a lower cap) are enumerated: every
    non-increasing assignment within each group, up to ``LOWER_LIMIT`` combinations (past that,
    the groups that do not fit draft nothing)."""
    n = len(acceptance)
    if n != len(caps):
        raise ValueError("acceptance and caps name the same requests")
    if n == 0:
        return []
    acc = [min(max(float(a), 0.0), 1.0) for a in acceptance]
    base_rows, base_tokens = other_rows + n, float(other_rows + n)  # prefill rows count as work done
    best = [0] * n
    best_ratio = base_tokens / cost.of(base_rows, best)
    by_cap: dict[int, list[int]] = {}
    for r in sorted(range(n), key=lambda r: -acc[r]):
        if caps[r] > 0:
            by_cap.setdefault(int(caps[r]), []).append(r)
    if not by_cap or _drafting_cannot_pay(acc, caps, cost, base_rows, best_ratio):
        return best
    # The DP takes the cap group with the most choices; the others are enumerated.
    main = max(by_cap, key=lambda c: (math.comb(len(by_cap[c]) + c, c), c))
    lower = _lower_choices({c: rs for c, rs in by_cap.items() if c != main}, acc)
    dp = _StepDP(acc, by_cap[main], main, cost, base_rows, sum(len(rs) * c for c, rs in by_cap.items()))
    while True:
        found: tuple[list[int], float] | None = None
        for fixed in lower:
            ks, value = dp.solve(best_ratio, fixed, base_tokens)
            if value > 1e-12 * best_ratio and (found is None or value > found[1]):
                found = (ks, value)
        if found is None:
            return best
        ks = found[0]
        ratio = (other_rows + sum(expected_tokens(a, k) for a, k in zip(acc, ks))) / cost.of(base_rows, ks)
        if ratio <= best_ratio * (1 + 1e-12):
            return best  # float rounding: nothing measurably better
        best_ratio, best = ratio, ks


LOWER_LIMIT = 16


def _drafting_cannot_pay(acc: list[float], caps: Sequence[int], cost: StepCost, base_rows: int,
                         base_ratio: float) -> bool:
    """A cheap proof that no drafts at all is ``choose_ks``'s answer (a large batch's usual case):
    for every total ``T`` of drafts, even the ``T`` best draft tokens (``a_r^j``, ``j <= caps[r]``)
    bring fewer tokens than ``base_ratio`` times the least the step can grow: ``T`` more target
    rows; draft steps at least as long as the first, which runs ``ceil(T / max cap)`` requests or
    more, and at least as long as ``max cap`` steps sharing the ``T`` rows evenly on the draft's
    convex envelope; the verify of those requests. False when the bound cannot tell (the exact
    search decides)."""
    n = len(acc)
    a = np.asarray(acc, dtype=np.float64)
    cap = np.asarray(caps, dtype=np.int64)
    m = int(cap.max())
    powers = a[:, None] ** np.arange(1, m + 1)[None, :]
    gains = np.sort(powers[np.arange(1, m + 1)[None, :] <= cap[:, None]])[::-1]
    totals = np.arange(1, len(gains) + 1)
    # At most m draft steps of at most n requests each, T rows in all: by Jensen, at least m times
    # the draft's lower convex envelope on [0, n] at T / m.
    xs, ys = _lower_hull([0.0, *(r for r, _ in cost.draft if 0 < r < n), float(n)], cost.draft)
    drafting = np.ceil(totals / m)  # at least this many requests draft, the first draft step runs them all
    draft = np.maximum(_at_many(cost.draft, drafting), m * np.interp(totals / m, xs, ys))
    grow = _at_many(cost.target, base_rows + totals) - _at(cost.target, base_rows) + draft + \
        _at_many(cost.verify, drafting)
    return bool(np.all(np.cumsum(gains) <= base_ratio * grow))


def _lower_hull(rows: list[float], points: Points) -> tuple[np.ndarray, np.ndarray]:
    """The vertices of the lower convex envelope of the piecewise-linear time ``points`` over
    ``rows`` (sorted; the time is linear between them)."""
    times = _at_many(points, np.array(rows)) if rows else np.zeros(0)
    hull: list[tuple[float, float]] = []
    for x, y in zip(rows, times.tolist()):
        # Drop the last vertex while it lies on or above the chord from the one before it to (x, y).
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= \
                (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((x, y))
    return np.array([h[0] for h in hull]), np.array([h[1] for h in hull])


def _lower_choices(groups: dict[int, list[int]], acc: list[float]) -> list[dict[int, int]]:
    """Every assignment of draft lengths to the shorter-cap requests, non-increasing in acceptance
    within each cap group (``groups``: cap -> requests, best acceptance first); of those with the
    same lengths in some order (the same cost), only the one bringing the most tokens."""
    choices: list[dict[int, int]] = [{}]
    for cap, rs in sorted(groups.items(), key=lambda g: math.comb(len(g[1]) + g[0], g[0])):
        if len(choices) * math.comb(len(rs) + cap, cap) > LOWER_LIMIT:
            options = [(0,) * len(rs)]
        else:
            options = list(itertools.combinations_with_replacement(range(cap, -1, -1), len(rs)))
        choices = [{**c, **dict(zip(rs, o))} for c in choices for o in options]
    best: dict[tuple[int, ...], tuple[float, dict[int, int]]] = {}
    for c in choices:
        key, tokens = tuple(sorted(c.values())), sum(expected_tokens(acc[r], k) for r, k in c.items())
        if key not in best or tokens > best[key][0]:
            best[key] = (tokens, c)
    return [c for _, c in best.values()]


def _sheared(table: np.ndarray) -> np.ndarray:
    """``out[c, t] = table[c, t - c]`` (``-inf`` where ``t < c``): a strided view of a padded copy."""
    rows, width = table.shape
    padded = np.full((rows, rows + width), -np.inf)
    padded[:, rows:] = table
    step = padded.strides[1]
    # Row c of the view starts at padded[c, rows - c]: a row stride one element short of a row.
    return np.lib.stride_tricks.as_strided(padded.ravel()[rows:], shape=(rows, width),
                                           strides=(padded.strides[0] - step, step), writeable=False)


class _StepDP:
    """``choose_ks``'s maximisation of ``tokens - lam * cost`` over the requests ``rs`` of one cap
    ``m`` (best acceptance first), the other requests' lengths given."""

    def __init__(self, acc: list[float], rs: list[int], m: int, cost: StepCost, base_rows: int, max_drafts: int):
        self.acc, self.rs, self.m = acc, rs, m
        a = np.array([acc[r] for r in rs])
        # gains[j - 1, c]: the tokens the j-th drafts of the first c requests bring.
        powers = a[None, :] ** np.arange(1, m + 1)[:, None]
        self.gains = np.concatenate([np.zeros((m, 1)), np.cumsum(powers, axis=1)], axis=1)
        drafts = np.arange(max_drafts + 1)
        self.draft, self.verify = _at_many(cost.draft, drafts), _at_many(cost.verify, drafts)
        self.target = _at_many(cost.target, base_rows + drafts)

    def solve(self, lam: float, fixed: dict[int, int], base_tokens: float) -> tuple[list[int], float]:
        """Every request's length (``fixed`` ones as given) and the best ``tokens - lam * cost``."""
        m, s, acc = self.m, len(self.rs), self.acc
        off = [sum(1 for k in fixed.values() if k >= j) for j in range(max([m, *fixed.values()]) + 1)]
        beyond = float(self.draft[off[m + 1:]].sum())  # draft steps past m: the fixed requests' alone
        width, counts = s * m + 1, np.arange(s + 1)
        # tables[j - 1][c, t]: the best value of steps 1..j with c requests at step j, t drafts so far.
        first = np.full((s + 1, width), -np.inf)
        first[counts, counts] = self.gains[0] - lam * (self.draft[counts + off[1]] + self.verify[counts + off[1]])
        tables = [first]
        for j in range(2, m + 1):
            at_least = np.maximum.accumulate(tables[-1][::-1], axis=0)[::-1]  # c or more at step j - 1
            step = self.gains[j - 1] - lam * self.draft[counts + off[j]]
            tables.append(_sheared(at_least) + step[:, None])
        final = tables[-1] - lam * (self.target[np.arange(width) + sum(fixed.values())][None, :] + beyond)
        c, t = (int(x) for x in np.unravel_index(int(np.argmax(final)), final.shape))
        tokens = base_tokens + sum(expected_tokens(acc[r], k) - 1.0 for r, k in fixed.items())
        value = float(final[c, t]) + tokens
        per_step = [c]
        for table in reversed(tables[:-1]):  # walk back: the count at each earlier step
            t -= c
            c += int(np.argmax(table[c:, t]))
            per_step.append(c)
        per_step.reverse()
        ks = [0] * len(acc)
        for r, k in fixed.items():
            ks[r] = k
        for i, r in enumerate(self.rs):
            ks[r] = sum(1 for c in per_step if c > i)
        return ks, value
