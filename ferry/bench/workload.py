"""Benchmark workloads: JSON files of requests, synthetic lengths, and arrival times."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds from the start of the run
    priority: int = 0  # lower is more urgent (scheduling_policy="priority")
    # Image models: the (width, height) of each image in front of the prompt's tokens, and their
    # ImageFeatures once made (``ferry.bench.images.with_images``).
    image_sizes: tuple[tuple[int, int], ...] = ()
    images: tuple = ()


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read a workload file (``{"requests": [...]}`` or a bare list)."""
    data = json.loads(Path(path).read_text())
    items = data["requests"] if isinstance(data, dict) else data
    out = []
    for i, r in enumerate(items):
        if "prompt_token_ids" not in r or "max_tokens" not in r:
            raise ValueError(f"{path}: request {i} needs prompt_token_ids and max_tokens")
        sizes = tuple(parse_image_size(v, f"{path}: request {i} image_sizes") for v in r.get("image_sizes", ()))
        out.append(WorkloadRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]),
                                   float(r.get("arrival_time", 0.0)), int(r.get("priority", 0)), sizes))
    return out


def save_workload(requests: list[WorkloadRequest], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"requests": [
        {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens,
         "arrival_time": r.arrival_time, "priority": r.priority,
         **({"image_sizes": [f"{w}x{h}" for w, h in r.image_sizes]} if r.image_sizes else {})} for r in requests]}))


def parse_image_size(value: str, what: str = "image size") -> tuple[int, int]:
    """"WxH" (e.g. "448x448") -> (width, height), both >= 1."""
    try:
        width, height = (int(v) for v in str(value).lower().split("x"))
    except ValueError:
        raise ValueError(f"{what}: expected WxH (e.g. 448x448), got {value!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"{what}: width and height must be >= 1, got {value!r}")
    return width, height


def sample_lengths(n: int, mean: int, dist: str, rng: random.Random, range_ratio: float = 0.5,
                   sigma: float = 1.0, max_len: int | None = None) -> list[int]:
    """``n`` lengths >= 1 around ``mean``.

    fixed: all ``mean``; uniform: in [mean * (1 - range_ratio), mean * (1 + range_ratio)];
    lognormal: a long tail with that mean and shape ``sigma``, clipped to ``max_len``.
    """
    if dist not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, got {dist!r}")
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    if dist == "fixed":
        lens = [mean] * n
    elif dist == "uniform":
        if not 0 <= range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        lo, hi = max(1, round(mean * (1 - range_ratio))), round(mean * (1 + range_ratio))
        lens = [rng.randint(lo, hi) for _ in range(n)]
    else:
        mu = math.log(mean) - sigma ** 2 / 2  # so that E[length] = mean
        lens = [max(1, round(rng.lognormvariate(mu, sigma))) for _ in range(n)]
    return [min(x, max_len) for x in lens] if max_len else lens


def synthetic_workload(num_prompts: int, input_len: int, output_len: int, input_dist: str = "fixed",
                       output_dist: str = "fixed", range_ratio: float = 0.5, sigma: float = 1.0,
                       seed: int = 0, vocab_size: int = 32000, max_len: int | None = None) -> list[WorkloadRequest]:
    """Random-token prompts with lengths from the named distributions (content does not matter
    with ignore_eos: only the lengths shape the schedule)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    ins = sample_lengths(num_prompts, input_len, input_dist, rng, range_ratio, sigma, max_len)
    outs = sample_lengths(num_prompts, output_len, output_dist, rng, range_ratio, sigma, max_len)
    # Skip the lowest ids: special tokens live there in most vocabularies.
    lo = min(100, vocab_size - 1)
    ids = range(lo, vocab_size)  # choices: ~5x faster than a randrange per token (10k prompts in 1 s)
    return [WorkloadRequest(rng.choices(ids, k=i), o) for i, o in zip(ins, outs)]


def shared_prefix_workload(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int,
                           output_len: int, request_rate: float = float("inf"), group_skew: float = 0.0,
                           seed: int = 0, vocab_size: int = 32000) -> list[WorkloadRequest]:
    """Requests that share prompt prefixes, as behind one system prompt or few-shot preamble each.

    ``num_groups`` random prefixes of ``prefix_len`` tokens; each request is one group's prefix plus
    its own random suffix of ``suffix_len`` tokens, and asks for ``output_len`` tokens. Group k
    (0-based) is drawn with probability proportional to ``1 / (k + 1) ** group_skew`` (Zipf; 0 is
    uniform, 1 gives the most popular of 64 groups about a fifth of the traffic). Poisson arrivals
    at ``request_rate`` (``inf``: all at 0). Seeded: the same arguments give the same requests.
    """
    for name, v, lo in (("num_prompts", num_prompts, 1), ("num_groups", num_groups, 1),
                        ("prefix_len", prefix_len, 0), ("suffix_len", suffix_len, 0), ("output_len", output_len, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_len + suffix_len must be >= 1: a prompt needs a token")
    if not group_skew >= 0 or math.isinf(group_skew):
        raise ValueError(f"group_skew must be a finite number >= 0, got {group_skew}")
    rng = random.Random(seed)
    ids = range(min(100, vocab_size - 1), vocab_size)  # as synthetic_workload: no special tokens
    prefixes = [rng.choices(ids, k=prefix_len) for _ in range(num_groups)]
    groups = rng.choices(range(num_groups), weights=[(k + 1) ** -group_skew for k in range(num_groups)],
                         k=num_prompts)
    reqs = [WorkloadRequest(prefixes[g] + rng.choices(ids, k=suffix_len), output_len) for g in groups]
    return with_request_rate(reqs, request_rate, seed)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s; ``inf`` puts all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def with_request_rate(requests: list[WorkloadRequest], rate: float | None, seed: int = 0) -> list[WorkloadRequest]:
    """Give the requests Poisson arrival times; ``None`` keeps the workload's own arrival_time."""
    if rate is None:
        return list(requests)
    return [replace(r, arrival_time=t) for r, t in zip(requests, poisson_arrivals(len(requests), rate, seed))]
