"""``ferry bench offline | online | serve | sweep | kernels | accuracy | batching-report``: the command-line side
of the benchmarks."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import median
from typing import Any, Callable

from ferry.bench.batching_report import DEFAULT_MIXED
from ferry.bench.images import with_images
from ferry.bench.workload import LENGTH_DISTRIBUTIONS, WorkloadRequest, load_workload, synthetic_workload
from ferry.config import EngineConfig


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (a file, or synthetic lengths; --seed seeds both)")
    g.add_argument("--workload", help="JSON file of requests with prompt_token_ids and max_tokens")
    g.add_argument("--num-prompts", type=int, help="synthetic: number of requests")
    g.add_argument("--input-len", type=int, default=256, help="synthetic: mean prompt length")
    g.add_argument("--output-len", type=int, default=128, help="synthetic: mean output length")
    g.add_argument("--input-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed")
    g.add_argument("--output-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed")
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths within mean*(1 +- r)")
    g.add_argument("--sigma", type=float, default=1.0, help="lognormal: shape (larger, longer tail)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", help="write the results here as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def workload_from_args(args: argparse.Namespace, vocab_size: int = 32000) -> list[WorkloadRequest]:
    if args.workload and args.num_prompts:
        raise ValueError("give either --workload or --num-prompts, not both")
    if args.workload:
        return load_workload(args.workload)
    if not args.num_prompts:
        raise ValueError("give a workload: --workload FILE or --num-prompts N (synthetic)")
    return synthetic_workload(args.num_prompts, args.input_len, args.output_len, args.input_dist,
                              args.output_dist, args.range_ratio, args.sigma, args.seed, vocab_size)


def write_json(path: str | None, data: Any) -> None:
    """Indented JSON; a dict's "steps" list (thousands of records) is written one record a line."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        steps = data.get("steps") if isinstance(data, dict) else None
        if steps is None:
            text = json.dumps(data, indent=2, default=_json_default)
        else:
            text = json.dumps({k: v for k, v in data.items() if k != "steps"}, indent=2, default=_json_default)
            lines = ",\n".join("    " + json.dumps(r, separators=(",", ":")) for r in steps)
            text = text[:-2] + (",\n" if len(data) > 1 else "\n") + f'  "steps": [\n{lines}\n  ]\n}}'
        Path(path).write_text(text)
        print(f"wrote {path}")


def step_records(runs: list[Any]) -> list[dict[str, Any]]:
    """Every step of these runs as calibration reads it (``ferry simulate calibrate --from-run``):
    wall time (s), LM-head rows, (num_tokens, start) per chunk."""
    return [{"run": i, "wall": round(s.wall, 6), "rows": s.num_sampling_rows, "chunks": s.shape}
            for i, r in enumerate(runs) for s in r.steps]


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return str(v)


def cmd_bench_run(args: argparse.Namespace, config: EngineConfig, factory: Any = None) -> int:
    """offline and online (and ``ferry simulate``, with a simulated factory): one configuration,
    ``--num-runs`` times on the same engine."""
    from ferry.bench.plots import plot_cdfs, plot_run
    from ferry.bench.runner import EngineFactory, run_workload
    from ferry.bench.workload import with_request_rate
    from ferry.engine.profiler import StepProfiler

    online = args.bench_command != "offline"
    engine = (factory or EngineFactory()).engine(config)
    reqs = workload_from_args(args, engine.executor.vocab_size or 32000)
    reqs = with_images(reqs, engine.image_prompter, getattr(args, "image_size", None))
    rate = args.request_rate if online else float("inf")
    if online and rate is None and not any(r.arrival_time for r in reqs):
        print("note: the workload has no arrival_time and no --request-rate was given: all arrive at once")
    reqs = with_request_rate(reqs, rate, args.seed)
    print(f"{len(reqs)} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
          f"{sum(r.max_tokens for r in reqs)} output tokens; scheduler={config.scheduler}, "
          f"max_num_batched_tokens={config.max_num_batched_tokens}, max_num_seqs={config.max_num_seqs}")
    label = f"{config.scheduler}" + (f", rate={args.request_rate:g}" if online and args.request_rate else "")
    profiler = StepProfiler() if getattr(args, "profile", False) else None  # sim: no --profile
    if profiler is not None:
        engine.attach_profiler(profiler)
    runs = []
    for i in range(args.num_runs):
        run = run_workload(engine, reqs, label=label, progress=not args.no_progress,
                           extra={"request_rate": "workload" if rate is None else rate},
                           temperature=getattr(args, "temperature", 0.0))
        runs.append(run)
        m = run.metrics
        print(f"run {i + 1}: {m.duration:.2f} s, {m.output_throughput:.1f} output tok/s, "
              f"{m.num_preemptions} preemptions")
    mid = sorted(runs, key=lambda r: r.metrics.duration)[len(runs) // 2]
    if len(runs) > 1:
        print(f"median of {len(runs)}: {median(r.metrics.duration for r in runs):.2f} s, "
              f"{median(r.metrics.output_throughput for r in runs):.1f} output tok/s (table: the median run)")
    print("\n".join(mid.metrics.lines()))
    if profiler is not None:
        print(f"\nstep profile (all {len(runs)} run(s); each part includes the Python around it):")
        print(profiler.table())
    floor: dict[str, Any] = {}
    if not online and len(reqs) == 1 and factory is None:  # one request: a decode step reads every weight once a token
        from ferry.bench.bandwidth import decode_report

        lines, floor = decode_report(getattr(engine.executor, "model", None), mid.metrics.stat("tpot", "median"),
                                     profiler.to_dict() if profiler is not None else None)
        if lines:
            print("\nmemory floor (one request's decode):\n" + "\n".join(lines))
    write_json(args.output_json, {**mid.to_dict(), "durations": [r.metrics.duration for r in runs],
                                   **({"profile": profiler.to_dict()} if profiler is not None else {}),
                                   **({"encoder": profiler.encoder_summary()}
                                      if profiler is not None and profiler.encoder_summary() else {}),
                                   **({"memory_floor": floor} if floor else {}),
                                   "num_kv_blocks": engine.num_kv_blocks, "steps": step_records(runs)})
    if args.plot:
        paths = plot_run(mid, args.plot, args.bench_command)
        plot_cdfs([mid], Path(args.plot) / f"{args.bench_command}-cdf.png")
        print(f"plots in {args.plot}: {', '.join(p.name for p in paths.values())}, {args.bench_command}-cdf.png")
    return 0


def cmd_bench_sweep(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.plots import plot_cdfs, plot_sweep
    from ferry.bench.runner import EngineFactory
    from ferry.bench.sweep import (SWEEPABLE, best_under_slo, format_points, meets_slo, parse_list, parse_rate,
                                   parse_slo, run_sweep, split_grid)

    slo = parse_slo(args.slo)
    config, grid = split_grid(config, {name: parse_list(name, text, SWEEPABLE[name])
                                       for name, text in args.sweep.items()})
    rates: list[float | None] = [None] if args.request_rate is None else \
        parse_list("request_rate", args.request_rate, parse_rate)
    factory = EngineFactory()
    engine0 = factory.engine(config)
    reqs = workload_from_args(args, engine0.executor.vocab_size or 32000)
    runs, skipped = run_sweep(config, reqs, grid, rates, args.seed, factory, progress=not args.no_progress)
    points = [r.to_dict() for r in runs]
    best = best_under_slo(points, slo) if slo else None
    def mark(p: dict[str, Any]) -> str:
        return (("SLO ok" if meets_slo(p, slo) else "SLO miss") if slo else "") + ("  <- best" if p is best else "")

    print("\n".join(format_points(points, mark)))
    for s in skipped:
        print(f"skipped {s}")
    if slo and best is None:
        print("no configuration meets the SLO")
    write_json(args.output_json, {"grid": grid, "request_rates": rates, "slo": slo,
                                   "best": None if best is None else best["label"],
                                   "skipped": skipped, "points": points})
    if args.plot:
        vary = "request_rate" if len(rates) > 1 else next(iter(grid), "label")
        group_by = [k for k in grid if k != vary]
        plot_sweep(points, Path(args.plot) / "sweep.png", group_by, vary, slo, best)
        plot_cdfs(runs, Path(args.plot) / "sweep-cdf.png")
        print(f"plots in {args.plot}: sweep.png, sweep-cdf.png")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from ferry.bench.serve_client import run_against_server
    from ferry.bench.workload import with_request_rate

    reqs = with_request_rate(workload_from_args(args), args.request_rate, args.seed)
    m = asyncio.run(run_against_server(args.base_url, reqs, args.model, args.api_key, args.max_concurrency,
                                       progress=not args.no_progress, reset_prefix_cache=args.reset_prefix_cache))
    print("\n".join(m.lines()))
    if m.num_failed:
        print(f"{m.num_failed} requests failed")
    write_json(args.output_json, {"base_url": args.base_url, "request_rate": args.request_rate,
                                   "max_concurrency": args.max_concurrency, **m.to_dict()})
    return 0


def cmd_bench_kernels(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.kernels import bench_kernels, format_kernels
    from ferry.executor.model_executor import ModelExecutor

    rows = [int(r) for r in args.rows.split(",")]
    report = bench_kernels(ModelExecutor(config).model, rows, args.reps)
    print(format_kernels(report))
    write_json(args.output_json, report)
    return 0


def cmd_bench_accuracy(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.accuracy import run_accuracy

    text = Path(args.perplexity_text).read_text() if args.perplexity_text else None
    r = run_accuracy(config, text, args.ctx_size)
    print(f"{r['settings']} against float32 products on the same weights, {r['positions']} positions: "
          f"top-1 agreement {100 * r['top1_agreement']:.2f}%, logprob difference mean "
          f"{r['mean_abs_logprob_diff']:.4f}, max {r['max_abs_logprob_diff']:.4f} (nats)")
    if text is not None:
        p = r["perplexity"]
        print(f"perplexity of {args.perplexity_text} ({p['tokens']} tokens, {p['exact']['chunks']} chunks of "
              f"{args.ctx_size}, as llama-perplexity -c {args.ctx_size} scores them): exact "
              f"{p['exact']['perplexity']:.4f}, these settings {p['these settings']['perplexity']:.4f}")
    write_json(args.output_json, r)
    return 0


def cmd_bench_batching_report(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.batching_report import run_batching_report

    report = run_batching_report(config, args.out, quick=args.quick, progress=not args.no_progress,
                                 mixed_path=args.mixed_workload, plots=not args.no_plots, only=args.only)
    print(f"wrote {report}")
    return 0


def add_bench_parsers(sub: Any, add_engine_args: Callable[..., None],
                      run: Callable[[Callable[[argparse.Namespace, EngineConfig], int]], Any]) -> None:
    """Register ``ferry bench ...``; ``run(handler)`` wraps a handler with the engine config."""
    from ferry.bench.sweep import SWEEPABLE

    bench = sub.add_parser("bench", help="benchmarks, sweeps, plots and the batching report")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, text in (("offline", "every request submitted at once (ignore_eos)"),
                       ("online", "requests arrive over time (Poisson --request-rate, or the workload's "
                                  "arrival_time) into the engine while it steps")):
        p = bsub.add_parser(name, help=text, description=text)
        add_workload_args(p)
        p.add_argument("--image-size", metavar="WxH", default=None,
                       help="image models: each request whose workload entry names no image_sizes starts "
                            "with one image of this size (a deterministic pattern, its own per image: no encoder "
                            "cache hits), then its tokens")
        if name == "online":
            p.add_argument("--request-rate", type=parse_rate_arg, default=None,
                           help="requests/s, Poisson (seeded by --seed); inf = all at once")
        p.add_argument("--num-runs", type=int, default=1, help="repeat on the same engine; report the median")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="sample at this temperature (request i seeded with i) instead of greedy")
        p.add_argument("--profile", action="store_true",
                       help="time each step by part (projections, attention, sampling, scheduler, ...) "
                            "and step shape; a table, and 'profile' in the JSON")
        add_output_args(p)
        add_engine_args(p)
        p.set_defaults(func=run(cmd_bench_run))
    p = bsub.add_parser("serve", help="load an OpenAI-compatible server over HTTP (streaming, token-id prompts)")
    add_workload_args(p)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: none; the server's own)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=parse_rate_arg, default=None,
                   help="requests/s, Poisson (seeded by --seed); inf = all at once; default: the workload's own")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="first ask the server to forget its cached prefixes (POST /reset_prefix_cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench_serve)
    p = bsub.add_parser("sweep", help="a grid of settings and rates; throughput vs p99 latency; SLO pick",
                        description="Comma-separated values for any of: " + ", ".join(
                            "--" + k.replace("_", "-") for k in SWEEPABLE))
    add_workload_args(p)
    p.add_argument("--request-rate", help="comma-separated rates (requests/s, inf = all at once)")
    p.add_argument("--slo", help="e.g. ttft_p99=2000,tpot_p99=100 (ms): mark the best configuration within it")
    add_output_args(p)
    add_engine_args(p, lists=tuple(SWEEPABLE))
    p.set_defaults(func=run(cmd_bench_sweep))
    p = bsub.add_parser("kernels", help="the model's matrix products at decode sizes: ferry's kernels, torch, "
                                         "numpy (OpenBLAS), against the memory or FMA bound")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="comma-separated M (rows) to time")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (the median is kept)")
    p.add_argument("--output-json")
    add_engine_args(p)
    p.set_defaults(func=run(cmd_bench_kernels))
    p = bsub.add_parser("accuracy", help="the accuracy cost of these engine settings (e.g. --fp32-matmul-precision "
                                          "bf16) against float32 products: top-1 agreement, logprob difference")
    p.add_argument("--perplexity-text", help="a text file: also both engines' perplexity on it, computed as "
                                             "llama-perplexity does (compare with `llama-perplexity -f FILE -c N`)")
    p.add_argument("--ctx-size", type=int, default=512, help="perplexity chunk length (llama-perplexity's -c)")
    p.add_argument("--output-json")
    add_engine_args(p)
    p.set_defaults(func=run(cmd_bench_accuracy))
    p = bsub.add_parser("batching-report", help="the batching experiments (a)-(d) and the policies (f) on this engine: "
                                                 "DIR/report.md and plots")
    p.add_argument("--out", required=True, help="directory for report.md and the plots")
    p.add_argument("--quick", action="store_true", help="small versions of every experiment (a minute)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--only", default="abcdef", help="which experiments, e.g. 'f' or 'ad' (default: all)")
    p.add_argument("--mixed-workload", default=str(DEFAULT_MIXED),
                   help="the mixed-lengths workload of experiment (a) (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run(cmd_bench_batching_report))


def parse_rate_arg(text: str) -> float:
    from ferry.bench.sweep import parse_rate

    try:
        rate = parse_rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rate must be a number or inf, got {text!r}") from None
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0, got {text!r}")
    return rate
