"""The batching report: experiments (a)-(f), run on an engine and written up as DIR/report.md.

The report states what the engine measured, next to what the batching literature claims
(Orca's iteration-level scheduling, SARATHI's chunked prefills, vLLM's blog), whether or not
they agree. Engines come from a factory, so the same experiments run on the real model
(``ferry bench batching-report``) or on a simulated executor (``ferry simulate batching-report``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ferry.bench import plots
from ferry.bench.runner import BenchRun, EngineFactory, engine_config, run_workload
from ferry.bench.workload import WorkloadRequest, load_workload, sample_lengths, synthetic_workload
from ferry.config import EngineConfig
from ferry.engine.metrics import summarize

DEFAULT_MIXED = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads" / "mixed-64.json"


@dataclass
class Scale:
    """Sizes of every experiment; ``quick`` shrinks them to about a minute on this CPU."""

    longtail_n: int = 48
    longtail_out: int = 96
    # the 32-request static-waste case: n output lengths of this mean and maximum
    waste_n: int = 32
    waste_mean: int = 100
    waste_max: int = 2000
    static_batch: int = 16
    decoders: int = 16
    decoder_out: int = 400
    long_prompts: tuple[int, ...] = (1500, 2000, 1700, 1900)
    long_every: float = 3.0
    no_chunk_budget: int = 2048
    chunk_budgets: tuple[int, ...] = (512, 256)
    sweep_n: int = 32
    sweep_in: int = 256
    sweep_out: int = 64
    sweep_rate: float = 2.0
    sweep_budgets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    overload_n: int = 48
    overload_rate: float = 4.0
    overload_seqs: int = 8
    use_mixed: bool = True
    # (f) policies: normal requests filling max_num_seqs, urgent ones arriving every urgent_every s
    policy_normal_n: int = 24
    policy_normal_out: int = 96
    policy_seqs: int = 8
    urgent_n: int = 8
    urgent_every: float = 1.0
    # ... and short prompts arriving behind long ones, with and without the partial-prefill caps
    caps_long: tuple[int, ...] = (1500, 1500)
    caps_short_n: int = 8
    caps_short_every: float = 0.25
    caps_threshold: int = 128
    caps_budget: int = 512
    # (e), simulation only: request rates at which to compare throughput at equal latency
    equal_latency_rates: tuple[float, ...] = ()
    equal_latency_n: int = 400


QUICK = Scale(longtail_n=8, longtail_out=24, waste_n=8, waste_mean=12, waste_max=60, static_batch=4,
              decoders=4, decoder_out=40, long_prompts=(300, 400), long_every=0.5, no_chunk_budget=512,
              chunk_budgets=(64,), sweep_n=8, sweep_in=64, sweep_out=16, sweep_rate=8.0,
              sweep_budgets=(32, 128), overload_n=12, overload_rate=20.0, overload_seqs=3, use_mixed=False,
              policy_normal_n=6, policy_normal_out=24, policy_seqs=2, urgent_n=3, urgent_every=0.3,
              caps_long=(300, 300), caps_short_n=3, caps_short_every=0.1, caps_threshold=32,
              caps_budget=128)


# Sizes for a big model on a big GPU (ferry simulate batching-report): thousands of requests, 64-request static batches.
GPU = Scale(longtail_n=1000, longtail_out=200, static_batch=64, decoders=64, decoder_out=1500,
            long_prompts=(1500, 2000, 1800, 1600, 1900, 1700, 2000, 1500, 1800, 1600), long_every=0.5,
            no_chunk_budget=8192, chunk_budgets=(2048, 512), sweep_n=1000, sweep_in=512, sweep_out=256,
            sweep_rate=20.0, sweep_budgets=(256, 512, 1024, 2048, 4096, 8192), overload_n=2000,
            overload_rate=300.0, overload_seqs=64, equal_latency_rates=(1, 2, 4, 8, 16, 32, 64, 128),
            equal_latency_n=1000, policy_normal_n=512, policy_normal_out=512, policy_seqs=128, urgent_n=40,
            urgent_every=0.25, caps_long=(16000, 16000, 16000, 16000), caps_short_n=64, caps_short_every=0.05,
            caps_threshold=1024, caps_budget=8192)


def static_waste_lengths(n: int, mean: int, longest: int, seed: int = 0) -> list[int]:
    """``n`` output lengths with the given mean and maximum: one request of ``longest`` tokens,
    the rest a lognormal tail scaled so the total is exactly ``n * mean``."""
    rest_total = n * mean - longest
    if n < 2 or rest_total < n - 1:
        raise ValueError(f"cannot make {n} lengths with mean {mean} and max {longest}")
    rest = sample_lengths(n - 1, max(1, rest_total // (n - 1)), "lognormal", random.Random(seed), sigma=1.0)
    scaled = [max(1, min(longest, round(x * rest_total / sum(rest)))) for x in rest]
    scaled[0] += rest_total - sum(scaled)  # rounding leftovers
    assert scaled[0] >= 1 and sum(scaled) == rest_total
    return [longest] + scaled


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


class Report:
    """Markdown lines plus the pictures, written into one directory."""

    def __init__(self, out_dir: str | Path, plots: bool = True) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []
        self.plots = plots

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.add("| " + " | ".join(header) + " |", "|" + "---|" * len(header))
        self.add(*("| " + " | ".join(str(c) for c in row) + " |" for row in rows))
        self.add("")

    def image(self, name: str, draw: Callable[[Path], Any], caption: str) -> None:
        if self.plots:
            draw(self.dir / name)
            self.add(f"![{caption}]({name})", "")

    def write(self) -> Path:
        path = self.dir / "report.md"
        path.write_text("\n".join(self.lines) + "\n")
        return path


def run_batching_report(base: EngineConfig, out_dir: str | Path, quick: bool = False, progress: bool = True,
                        factory: Any = None, mixed_path: str | Path | None = DEFAULT_MIXED,
                        title: str = "ferry: the batching experiments on the real engine",
                        scale: Scale | None = None, plots: bool = True, only: str = "abcdef") -> Path:
    """Run (a)-(d) and (f) ((e) too at a scale that asks for it; ``only`` picks some) and write
    ``out_dir/report.md``; returns its path."""
    scale = scale or (QUICK if quick else Scale())
    factory = factory or EngineFactory()
    rep = Report(out_dir, plots)
    probe = factory.engine(base)
    vocab = probe.executor.vocab_size or 32000

    def run(config: EngineConfig, reqs: list[WorkloadRequest], label: str) -> BenchRun:
        return run_workload(factory.engine(config), reqs, label=label, progress=progress)

    rep.add(f"# {title}", "",
            f"Engine: model={base.model or 'embedded SmolLM2-135M-Instruct'}, dtype={base.dtype}, "
            f"max_num_batched_tokens={base.max_num_batched_tokens}, max_num_seqs={base.max_num_seqs}, "
            f"block_size={base.block_size}, {probe.num_kv_blocks} KV blocks"
            + (" (quick sizes)" if quick else "") + ". Every request is greedy with ignore_eos, so it "
            "generates exactly max_tokens. Figures are what this run measured.", "")
    if "a" in only:
        _static_vs_continuous(rep, base, scale, run, vocab, mixed_path)
    if "b" in only:
        _interference(rep, base, scale, run, vocab)
    if "c" in only:
        _budget_sweep(rep, base, scale, run, vocab)
    if "d" in only:
        _priority(rep, base, scale, run, vocab)
    if "e" in only and scale.equal_latency_rates:
        _equal_latency(rep, base, scale, run, vocab)
    if "f" in only:
        _urgent_preemption(rep, base, scale, run, vocab)
        _prefill_caps(rep, base, scale, run, vocab)
    return rep.write()


# ---------------------------------------------------------------- (a)
def _static_vs_continuous(rep: Report, base: EngineConfig, s: Scale, run, vocab: int,
                          mixed_path: str | Path | None) -> None:
    rep.add("## (a) Static vs continuous batching on mixed lengths", "",
            "The batching literature claims: static batching keeps the GPU about 30% busy, continuous batching "
            "above 80%; with 32 sequences of mean length 100 and max 2000 a static batch wastes about 95%. "
            f"Static batches here hold B = {s.static_batch} requests (B = {s.waste_n} for the {s.waste_n}-request "
            "case) and "
            "recompute finished requests' slots until the batch ends. *Slot utilisation* = useful tokens / "
            "token slots computed (prefill included); *generation slot utilisation* = output tokens / "
            "(output tokens + idle slot-steps), the measure those claims use.", "")
    sets: list[tuple[str, list[WorkloadRequest], int]] = []
    if s.use_mixed and mixed_path and Path(mixed_path).exists():
        sets.append(("mixed-64", load_workload(mixed_path), s.static_batch))
    elif s.use_mixed:
        rep.add(f"(mixed-64 not found at {mixed_path}: skipped)", "")
    sets.append((f"long-tail ({s.longtail_n} req, lognormal out)",
                 synthetic_workload(s.longtail_n, 64, s.longtail_out, "uniform", "lognormal", seed=1,
                                    vocab_size=vocab), s.static_batch))
    waste_lens = static_waste_lengths(s.waste_n, s.waste_mean, s.waste_max)
    rng = random.Random(2)
    waste_reqs = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(16)], n) for n in waste_lens]
    waste_case = f"{s.waste_n}-request case"
    sets.append((f"{waste_case} ({s.waste_n} req, mean {s.waste_mean}, max {s.waste_max})", waste_reqs, s.waste_n))
    rows, runs = [], {}
    for name, reqs, batch in sets:
        for sched in ("continuous", "static"):
            config = engine_config(base, scheduler=sched, max_num_seqs=batch if sched == "static" else
                                   max(base.max_num_seqs, batch))
            r = run(config, reqs, f"{name}: {sched}")
            runs[(name, sched)] = r
            m = r.metrics
            rows.append([name, sched if sched == "continuous" else f"static B={batch}", f"{m.duration:.1f}",
                         f"{m.output_throughput:.1f}", _pct(m.slot_utilization),
                         _pct(m.generation_slot_utilization), _ms(m.stat("queue", "mean")),
                         _ms(m.stat("ttft", "mean")), _ms(m.stat("e2el", "mean"))])
    rep.table(["workload", "scheduler", "duration (s)", "output tok/s", "slot util.", "generation slot util.",
               "mean queue (ms)", "mean TTFT (ms)", "mean E2E (ms)"], rows)
    for name, _, _ in sets:
        c, st = runs[(name, "continuous")].metrics, runs[(name, "static")].metrics
        rep.add(f"- {name}: continuous / static throughput = {c.output_throughput / st.output_throughput:.2f}x, "
                f"mean queueing {_ms(st.stat('queue', 'mean'))} ms (static) vs {_ms(c.stat('queue', 'mean'))} ms.")
    waste_name = sets[-1][0]
    st = runs[(waste_name, "static")].metrics
    formula = 1 - sum(waste_lens) / (len(waste_lens) * max(waste_lens))
    rep.add(f"- {waste_case}: the static batch wasted {1 - st.generation_slot_utilization:.1%} of its generation "
            f"slots (1 - sum(L) / (n * max L) = {formula:.1%}; the batching literature claims about 95%); "
            f"counting prefill slots too, {1 - st.slot_utilization:.1%} of all token slots. Continuous batching "
            f"wasted {1 - runs[(waste_name, 'continuous')].metrics.generation_slot_utilization:.1%}.", "")
    rep.add(f"Timelines of the {waste_case} (one row per request, one column per step): the static batch "
            "holds finished requests' slots (orange) until its longest request ends; continuous batching "
            "lets them leave.", "")
    rep.image("a-timeline-static.png", lambda p: plots.plot_timeline(runs[(waste_name, "static")], p),
              "static batching timeline")
    rep.image("a-timeline-continuous.png", lambda p: plots.plot_timeline(runs[(waste_name, "continuous")], p),
              "continuous batching timeline")
    first = sets[0][0]
    rep.image("a-cdf.png", lambda p: plots.plot_cdfs([runs[(first, "continuous")], runs[(first, "static")]], p),
              f"TTFT/TPOT/ITL CDFs, {first}")


# ---------------------------------------------------------------- (b)
def _interference(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    rep.add("## (b) Long prefills interfering with decodes", "",
            f"{s.decoders} requests decode steadily ({s.decoder_out} output tokens each, short prompts) while "
            f"{len(s.long_prompts)} long prompts ({', '.join(map(str, s.long_prompts))} tokens) arrive every "
            f"{s.long_every:g} s. Without chunking a long prompt is prefilled in one step and every decode waits "
            "for it; with chunking it is cut to the token budget. The design says decode P95 TPOT can slow "
            "3-5x without chunking, and marks that unverified: this is the check.", "")
    rng = random.Random(3)
    decoders = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(32)], s.decoder_out)
                for _ in range(s.decoders)]
    # The long prompts start once the decoders are all running.
    longs = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(n)], 16, arrival_time=s.long_every * (i + 1))
             for i, n in enumerate(s.long_prompts)]
    reqs = decoders + longs
    max_len = max(s.no_chunk_budget, max(s.long_prompts) + 16)
    configs = [("chunked prefill off", engine_config(base, enable_chunked_prefill=False, max_model_len=max_len,
                                                     max_num_batched_tokens=s.no_chunk_budget))]
    configs += [(f"chunked, budget {b}", engine_config(base, enable_chunked_prefill=True, max_model_len=max_len,
                                                       max_num_batched_tokens=b)) for b in s.chunk_budgets]
    rows, runs, dec_runs = [], [], []
    for label, config in configs:
        r = run(config, reqs, label)
        runs.append(r)
        dec = summarize(r.outputs[:s.decoders], r.metrics.duration)
        lng = summarize(r.outputs[s.decoders:], r.metrics.duration)
        dec_runs.append(replace(r, metrics=dec, label=f"decoders, {label}"))
        rows.append([label, _ms(dec.stat("tpot", "mean")), _ms(dec.stat("tpot", "p95")), _ms(dec.stat("tpot", "p99")),
                     _ms(dec.stat("itl", "p99")), _ms(dec.stat("itl", "max")), _ms(lng.stat("ttft", "mean")),
                     f"{r.metrics.output_throughput:.1f}"])
    rep.table(["configuration", "decode mean TPOT (ms)", "p95 TPOT", "p99 TPOT", "p99 ITL", "max ITL",
               "long prompts' mean TTFT (ms)", "output tok/s"], rows)
    off = dec_runs[0].metrics
    for (label, _), d in zip(configs[1:], dec_runs[1:]):
        on = d.metrics
        rep.add(f"- off / {label}: p95 TPOT {off.stat('tpot', 'p95') / on.stat('tpot', 'p95'):.2f}x, "
                f"p99 ITL {off.stat('itl', 'p99') / on.stat('itl', 'p99'):.2f}x, "
                f"max ITL {off.stat('itl', 'max') / on.stat('itl', 'max'):.2f}x.")
    rep.add("", "TPOT averages a request's whole decode, so the same prefill work spread over more steps "
            "changes it little; the stall a user sees is the ITL tail.", "")
    rep.image("b-steps-off.png", lambda p: plots.plot_steps(runs[0], p), "tokens per step, chunking off")
    rep.image("b-steps-on.png", lambda p: plots.plot_steps(runs[-1], p), "tokens per step, chunking on")
    rep.image("b-cdf.png", lambda p: plots.plot_cdfs(dec_runs, p), "decoders' latency CDFs")


# ---------------------------------------------------------------- (c)
def _budget_sweep(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    from ferry.bench.workload import with_request_rate

    rep.add("## (c) The token budget trade-off", "",
            f"{s.sweep_n} requests (prompts {s.sweep_in} +-50%, outputs {s.sweep_out} +-50%) arriving as a "
            f"Poisson process at {s.sweep_rate:g} req/s, for each max_num_batched_tokens. A small budget keeps "
            "steps short (low TPOT) but prefills slowly (high TTFT); a large one the opposite.", "")
    reqs = with_request_rate(synthetic_workload(s.sweep_n, s.sweep_in, s.sweep_out, "uniform", "uniform", seed=4,
                                                vocab_size=vocab), s.sweep_rate, seed=4)
    rows, points = [], []
    for b in s.sweep_budgets:
        r = run(engine_config(base, max_num_batched_tokens=b), reqs, f"budget {b}")
        m = r.metrics
        points.append({**m.to_dict(), "max_num_batched_tokens": b})
        rows.append([b, f"{m.output_throughput:.1f}", _ms(m.stat("ttft", "median")), _ms(m.stat("ttft", "p99")),
                     _ms(m.stat("tpot", "median")), _ms(m.stat("tpot", "p99")), _ms(m.stat("itl", "max")), m.num_steps])
    rep.table(["max_num_batched_tokens", "output tok/s", "median TTFT (ms)", "p99 TTFT", "median TPOT (ms)",
               "p99 TPOT", "max ITL", "steps"], rows)
    rep.image("c-sweep.png", lambda p: plots.plot_sweep(points, p, [], "max_num_batched_tokens"),
              "throughput vs p99 latency over the token budget")


# ---------------------------------------------------------------- (d)
def _priority(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    from ferry.bench.workload import with_request_rate

    rep.add("## (d) FCFS vs priority under overload", "",
            f"{s.overload_n} requests at {s.overload_rate:g} req/s, more than the engine serves with "
            f"max_num_seqs={s.overload_seqs}, so a queue builds. Every 4th request is urgent (priority 0), "
            "the rest priority 1.", "")
    reqs = with_request_rate(synthetic_workload(s.overload_n, 128, 48, "uniform", "uniform", seed=5,
                                                vocab_size=vocab), s.overload_rate, seed=5)
    reqs = [replace(r, priority=0 if i % 4 == 0 else 1) for i, r in enumerate(reqs)]
    urgent = [i for i in range(len(reqs)) if i % 4 == 0]
    rows, class_runs = [], []
    for policy in ("fcfs", "priority"):
        r = run(engine_config(base, scheduling_policy=policy, max_num_seqs=s.overload_seqs), reqs, policy)
        hi = summarize([r.outputs[i] for i in urgent], r.metrics.duration)
        lo = summarize([o for i, o in enumerate(r.outputs) if i % 4], r.metrics.duration)
        class_runs += [replace(r, metrics=hi, label=f"{policy}: urgent"), replace(r, metrics=lo, label=f"{policy}: normal")]
        unfinished = sum(1 for o in r.outputs if o.outputs[0].finish_reason != "length")
        rows.append([policy, _ms(hi.stat("ttft", "mean")), _ms(hi.stat("ttft", "p99")), _ms(lo.stat("ttft", "mean")),
                     _ms(lo.stat("ttft", "p99")), _ms(lo.stat("queue", "max")), f"{r.metrics.completed}/{len(reqs)}",
                     unfinished, r.metrics.num_preemptions])
    rep.table(["policy", "urgent mean TTFT (ms)", "urgent p99 TTFT", "normal mean TTFT (ms)", "normal p99 TTFT",
               "longest wait (ms)", "completed", "not finished", "preemptions"], rows)
    rep.add("A request starves if it never finishes or waits without bound; in a finite run the longest wait "
            "of the normal class is the figure to watch.", "")
    rep.image("d-cdf.png", lambda p: plots.plot_cdfs(class_runs, p), "TTFT by class and policy")


# ---------------------------------------------------------------- (e)
def _equal_latency(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    from ferry.bench.workload import with_request_rate

    rep.add("## (e) Throughput at equal latency", "",
            "Orca reports up to 36.9x the throughput of FasterTransformer at the same latency. Here: "
            f"{s.equal_latency_n} ShareGPT-like requests (lognormal prompts of mean 220 and outputs of mean 200) "
            f"at rates {', '.join(f'{r:g}' for r in s.equal_latency_rates)} req/s, continuous batching vs static "
            f"batches of B = {s.static_batch}. Latency is Orca's normalised latency: mean over requests of "
            "end-to-end latency / output tokens. The target is 3x continuous batching's value at the lowest rate.", "")
    reqs = synthetic_workload(s.equal_latency_n, 220, 200, "lognormal", "lognormal", seed=6, vocab_size=vocab,
                              max_len=2048)
    points: list[dict] = []
    for sched in ("continuous", "static"):
        config = engine_config(base, scheduler=sched, max_num_seqs=s.static_batch if sched == "static"
                               else base.max_num_seqs)
        for rate in s.equal_latency_rates:
            r = run(config, with_request_rate(reqs, rate, seed=6), f"{sched}, rate {rate:g}")
            norm = [o.metrics.e2e / len(o.outputs[0].token_ids) for o in r.outputs]
            points.append({"scheduler": sched, "request_rate": rate, "output_throughput": r.metrics.output_throughput,
                           "normalized_latency_ms": 1e3 * sum(norm) / len(norm)})
    target = 3 * min(p["normalized_latency_ms"] for p in points if p["scheduler"] == "continuous")
    rep.table(["scheduler", "rate (req/s)", "output tok/s", "normalised latency (ms/token)"],
              [[p["scheduler"], f"{p['request_rate']:g}", f"{p['output_throughput']:.0f}",
                f"{p['normalized_latency_ms']:.1f}"] for p in points])
    best = {}
    for sched in ("continuous", "static"):
        ok = [p for p in points if p["scheduler"] == sched and p["normalized_latency_ms"] <= target]
        best[sched] = max((p["output_throughput"] for p in ok), default=None)
    c, st = best["continuous"], best["static"]
    top = {sched: max(p["output_throughput"] for p in points if p["scheduler"] == sched)
           for sched in ("continuous", "static")}
    rep.add(f"Within {target:.1f} ms/token: continuous {c:.0f} tok/s, static "
            + (f"{st:.0f} tok/s: {c / st:.1f}x." if st else "never within the target at these rates.")
            + f" Highest throughput at any latency: continuous {top['continuous']:.0f} tok/s, static "
            f"{top['static']:.0f} tok/s ({top['continuous'] / top['static']:.1f}x).", "")


# ---------------------------------------------------------------- (f)
def _urgent_preemption(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    rep.add("## (f) Policies ferry enforces: urgent requests preempting running work", "",
            f"{s.policy_normal_n} normal requests (priority 1, {s.policy_normal_out} output tokens) fill "
            f"max_num_seqs={s.policy_seqs} from the start; {s.urgent_n} urgent requests (priority 0, 16 output "
            f"tokens) arrive every {s.urgent_every:g} s. Under FCFS and under the priority policy alone (vLLM V1's "
            "behaviour) an urgent request waits for a running request to finish; with --priority-preemption it "
            "preempts the least urgent running one (recomputed later: that is the normal requests' cost). "
            "The cooldown (16 steps) keeps a preempted request from being preempted again at once.", "")
    rng = random.Random(7)
    normal = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(64)], s.policy_normal_out, priority=1)
              for _ in range(s.policy_normal_n)]
    urgent = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(32)], 16, priority=0,
                              arrival_time=s.urgent_every * (i + 1)) for i in range(s.urgent_n)]
    reqs = normal + urgent
    n = len(normal)
    configs = [("fcfs", dict(scheduling_policy="fcfs")),
               ("priority", dict(scheduling_policy="priority")),
               ("priority + preemption", dict(scheduling_policy="priority", priority_preemption=True)),
               ("priority + preemption + aging 0.1/s", dict(scheduling_policy="priority", priority_preemption=True,
                                                            priority_aging_rate=0.1))]
    rows, class_runs = [], []
    for label, kw in configs:
        r = run(engine_config(base, max_num_seqs=s.policy_seqs, **kw), reqs, label)
        hi = summarize(r.outputs[n:], r.metrics.duration)
        lo = summarize(r.outputs[:n], r.metrics.duration)
        class_runs.append(replace(r, metrics=hi, label=f"urgent, {label}"))
        rows.append([label, _ms(hi.stat("ttft", "mean")), _ms(hi.stat("ttft", "p99")), _ms(hi.stat("e2el", "mean")),
                     _ms(lo.stat("ttft", "mean")), _ms(lo.stat("e2el", "mean")), _ms(lo.stat("e2el", "max")),
                     f"{r.metrics.duration:.1f}", r.metrics.num_preemptions, r.metrics.num_recomputed_tokens])
    rep.table(["configuration", "urgent mean TTFT (ms)", "urgent p99 TTFT", "urgent mean E2E", "normal mean TTFT",
               "normal mean E2E (ms)", "normal max E2E", "duration (s)", "preemptions", "recomputed tokens"], rows)
    rep.image("f-urgent-cdf.png", lambda p: plots.plot_cdfs(class_runs, p), "urgent requests' latency by policy")


def _prefill_caps(rep: Report, base: EngineConfig, s: Scale, run, vocab: int) -> None:
    rep.add("## (f) Policies ferry enforces: short prompts behind long ones", "",
            f"{len(s.caps_long)} long prompts ({', '.join(map(str, s.caps_long))} tokens) arrive at once; then "
            f"{s.caps_short_n} short prompts (32 tokens, 16 output tokens) every {s.caps_short_every:g} s; "
            f"max_num_batched_tokens={s.caps_budget}. Without caps a "
            "running long prefill takes the whole budget each step and the short prompts wait. "
            f"--long-prefill-token-threshold {s.caps_threshold} caps every prefill chunk (the rest of the budget "
            "is left to others) and marks the long prompts; --max-long-partial-prefills 1 lets one long prompt "
            "prefill at a time, the short ones passing the second; --max-num-partial-prefills bounds how many "
            "prompts prefill at once.", "")
    rng = random.Random(8)
    longs = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(n)], 16) for n in s.caps_long]
    shorts = [WorkloadRequest([rng.randrange(100, vocab) for _ in range(32)], 16,
                              arrival_time=s.caps_short_every * (i + 1)) for i in range(s.caps_short_n)]
    n = len(longs)
    max_len = max(s.caps_long) + 16
    t = s.caps_threshold
    configs = [("no caps", {}),
               (f"threshold {t}", dict(long_prefill_token_threshold=t)),
               (f"threshold {t}, 1 long, 4 partial", dict(long_prefill_token_threshold=t, max_long_partial_prefills=1,
                                                          max_num_partial_prefills=4))]
    rows, class_runs = [], []
    for label, kw in configs:
        r = run(engine_config(base, max_model_len=max_len, max_num_batched_tokens=s.caps_budget, **kw),
                longs + shorts, label)
        short = summarize(r.outputs[n:], r.metrics.duration)
        long = summarize(r.outputs[:n], r.metrics.duration)
        class_runs.append(replace(r, metrics=short, label=f"short prompts, {label}"))
        rows.append([label, _ms(short.stat("ttft", "mean")), _ms(short.stat("ttft", "p99")),
                     _ms(long.stat("ttft", "mean")), _ms(long.stat("ttft", "max")), f"{r.metrics.duration:.1f}",
                     f"{r.metrics.output_throughput:.1f}"])
    rep.table(["configuration", "short mean TTFT (ms)", "short p99 TTFT", "long mean TTFT (ms)", "long max TTFT",
               "duration (s)", "output tok/s"], rows)
    rep.image("f-caps-cdf.png", lambda p: plots.plot_cdfs(class_runs, p), "short prompts' latency with and without caps")
