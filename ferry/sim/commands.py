"""``ferry simulate [run|calibrate|batching-report|route]`` and ``ferry tune``."""
from __future__ import annotations

import argparse
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ferry.config import EngineConfig
from ferry.sim.models import PRESETS as MODEL_PRESETS


def _factory(args: argparse.Namespace):
    from ferry.sim.engine import SimEngineFactory
    from ferry.sim.hardware import load_hardware
    from ferry.sim.models import load_model_config

    return SimEngineFactory(load_model_config(args.model or "smollm2-135m"), load_hardware(args.hardware),
                            args.tensor_parallel_size, args.gpu_memory_utilization, args.spec_acceptance_rate)


def cmd_simulate(args: argparse.Namespace, config: EngineConfig) -> int:
    action = args.action or "run"
    if action == "calibrate":
        return _calibrate(args, config)
    factory = _factory(args)
    config = _sim_dtype(config, factory)
    if action == "route":
        return _route(args, config, factory)
    if args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size is for ferry simulate route (got {args.data_parallel_size} "
                         f"with {action})")
    if action == "batching-report":
        from ferry.bench.batching_report import GPU, QUICK, run_batching_report

        if not args.out:
            raise ValueError("ferry simulate batching-report needs --out DIR")
        report = run_batching_report(
            config, args.out, progress=False, factory=factory, mixed_path=args.mixed_workload,
            scale=QUICK if args.quick else GPU, plots=not args.no_plots, only=args.only,
            title=f"ferry simulate: the batching experiments, {args.model or 'smollm2-135m'} on "
                  f"{args.tensor_parallel_size} x {factory.hw.name} (simulated)")
        print(f"wrote {report}")
        return 0
    from ferry.bench.commands import cmd_bench_run

    args.bench_command = "simulate"
    print(f"simulating {args.model or 'smollm2-135m'} on {args.tensor_parallel_size} x {factory.hw.name}: "
          f"{factory.num_kv_blocks(config)} KV blocks of {config.block_size} tokens")
    return cmd_bench_run(args, config, factory)


def parse_policies(text: str) -> list[str]:
    """``all`` or comma-separated router policies, in the order given."""
    from ferry.server.router import POLICIES

    names = list(POLICIES) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"--policies takes all or a comma-separated list of {', '.join(POLICIES)}; got {text!r}")
    return names


def _route(args: argparse.Namespace, config: EngineConfig, factory: Any) -> int:
    """``ferry simulate route``: one workload through --dp replicas, once per router policy."""
    from ferry.bench.commands import write_json
    from ferry.bench.workload import load_workload, shared_prefix_workload, with_request_rate
    from ferry.server.router import RouterConfig
    from ferry.sim.replicas import route_table, run_replicas

    dp = args.data_parallel_size
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp}")
    policies = parse_policies(args.policies or args.router_policy)
    rate = float("inf") if args.request_rate is None else args.request_rate
    arrivals = "all at once" if rate == float("inf") else f"{rate:g} req/s"
    if args.workload:
        if args.num_prompts:
            raise ValueError("give either --workload or --num-prompts, not both")
        reqs = with_request_rate(load_workload(args.workload), args.request_rate, args.seed)
        what = args.workload
        if args.request_rate is None:
            arrivals = "the workload's arrival times"
    else:
        reqs = shared_prefix_workload(args.num_prompts or 1000, args.num_groups, args.prefix_len, args.suffix_len,
                                      args.output_len, rate, args.group_skew, args.seed, factory.model.vocab_size)
        what = (f"{args.num_groups} groups (skew {args.group_skew:g}), prefix {args.prefix_len} + suffix "
                f"{args.suffix_len} tokens, output {args.output_len}")
    num_blocks = factory.num_kv_blocks(config)
    print(f"simulating {dp} replicas of {args.model or 'smollm2-135m'} on {args.tensor_parallel_size} x "
          f"{factory.hw.name}: {num_blocks} KV blocks of {config.block_size} tokens each; {len(reqs)} requests, "
          f"{what}, {arrivals}")
    runs = []
    for policy in policies:
        # The router remembers about as many blocks per replica as that replica's cache holds.
        rc = RouterConfig(policy=policy, block_size=config.block_size, cached_blocks_per_replica=num_blocks)
        runs.append(run_replicas(factory, config, reqs, dp, rc))
    print("\n".join(route_table(runs)))
    write_json(args.output_json, {"data_parallel_size": dp, "arrivals": arrivals, "workload": what,
                                   "num_kv_blocks": num_blocks, "runs": [r.to_dict() for r in runs]})
    return 0


def _sim_dtype(config: EngineConfig, factory: Any) -> EngineConfig:
    """In simulation the value size is the hardware profile's; say so in the settings reported."""
    return replace(config, dtype="float32" if factory.hw.dtype_bytes == 4 else "bfloat16")


def _calibrate(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.commands import write_json
    from ferry.executor.model_executor import ModelExecutor
    from ferry.sim.calibrate import calibration_shapes, fit_profile, measure_engine_overhead, measure_steps

    if args.from_run:
        return _calibrate_from_runs(args)
    if args.model in MODEL_PRESETS:
        config = replace(config, model=None)  # calibration runs the real model: the embedded one
    executor = ModelExecutor(config)
    shapes = calibration_shapes(executor.num_kv_blocks * executor.block_size)
    samples = measure_steps(executor, shapes, reps=args.reps, passes=args.passes, progress=not args.no_progress)
    dtype_bytes = {"float32": 4}.get(executor.dtype_name, 2)
    name = f"calibrated-{socket.gethostname()}-{executor.dtype_name}"
    hw, err = fit_profile(executor.model_config, samples, name, dtype_bytes,
                          memory_gb=config.kv_cache_memory_gb, kv_cache_memory_gb=config.kv_cache_memory_gb)
    # The engine's own work around each step (scheduling, stop checks, detokenizing) is real time too.
    step_s, req_s = measure_engine_overhead(executor, config)
    print(f"engine overhead around the executor: {step_s * 1e3:.2f} ms per step + {req_s * 1e3:.3f} ms per request")
    hw = replace(hw, step_overhead_ms=hw.step_overhead_ms + step_s * 1e3,
                             per_request_overhead_ms=hw.per_request_overhead_ms + req_s * 1e3)
    write_json(args.samples_json, [{"shape": s.shape, "seconds": s.seconds} for s in samples])
    return _save_profile(hw, err, args.out, f"{len(samples)} step shapes measured")


def _calibrate_from_runs(args: argparse.Namespace) -> int:
    """Fit a profile to the steps of ordinary benchmark runs: their wall time is everything the
    engine does per step, so no separate overhead measurement is needed."""
    from ferry.sim.calibrate import fit_profile, samples_from_runs
    from ferry.sim.models import load_model_config

    samples, settings = samples_from_runs(args.from_run)
    model = args.model or settings["model"] or "smollm2-135m"  # the embedded model: SmolLM2-135M's shapes
    try:
        model_config = load_model_config(model)
    except ValueError as e:
        raise ValueError(f"{e}; give the run's model shapes with --model") from None
    dtype_bytes = 2 if settings["dtype"] in ("bfloat16", "float16") else 4  # "auto" on the CPU is float32
    name = f"calibrated-{socket.gethostname()}-from-runs"
    kv_gb = settings["kv_cache_memory_gb"]
    hw, err = fit_profile(model_config, samples, name, dtype_bytes, memory_gb=kv_gb, kv_cache_memory_gb=kv_gb)
    return _save_profile(hw, err, args.out, f"{len(samples)} steps from {len(args.from_run)} run(s)")


def _save_profile(hw: Any, err: float, out: str | None, what: str) -> int:
    path = Path(out or "ferry-profile.json")
    hw.save(path)
    print(f"{what}; robust fit: linear {hw.flops / 1e9:.1f} GFLOP/s, attention {hw.attn_flops / 1e9:.1f} GFLOP/s, "
          f"memory {hw.bandwidth / 1e9:.1f} GB/s, context gather {hw.context_gather_gbs:.1f} GB/s (0: none), "
          f"overlap {hw.overlap:g},\n  step overhead {hw.step_overhead_ms:.2f} ms, per request "
          f"{hw.per_request_overhead_ms:.3f} ms, per prefill chunk {hw.per_prefill_chunk_ms:.2f} ms; "
          f"median error {err:.1%}")
    print(f"wrote {path}: use it with --hardware {path}")
    return 0


def cmd_tune(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.bench.commands import workload_from_args, write_json
    from ferry.bench.plots import plot_sweep
    from ferry.bench.runner import EngineFactory, engine_config, run_workload
    from ferry.bench.sweep import SWEEPABLE, format_points, parse_list, parse_slo, split_grid
    from ferry.bench.workload import with_request_rate
    from ferry.sim.tune import TUNE_GRID, ranked_within_slo, tune

    slo = parse_slo(args.slo)
    if not slo:
        raise ValueError("ferry tune needs --slo, e.g. --slo ttft_p99=2000,tpot_p99=100 (milliseconds)")
    factory = _factory(args)
    real_dtype = config.dtype  # --verify runs the real engine at the dtype asked for
    config = _sim_dtype(config, factory)
    reqs = workload_from_args(args, factory.model.vocab_size)
    if config.max_model_len is None:  # long enough for the workload, so chunking-off configs are comparable
        need = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
        config = engine_config(config, max_model_len=min(factory.model.max_position_embeddings, need))
    # Settings the user gave replace the default grid's.
    config, grid = split_grid(config, {**TUNE_GRID, **{name: parse_list(name, text, SWEEPABLE[name])
                                                      for name, text in args.sweep.items()}})
    res = tune(config, reqs, args.request_rate, slo, factory, grid, progress=False)
    print(f"{len(res.points)} configurations simulated on {factory.hw.name}"
          + (f", {len(res.skipped)} skipped (chunking off needs max_num_batched_tokens >= max_model_len "
             f"{config.max_model_len})" if res.skipped else ""))
    print("frontier (no configuration is better on throughput, p99 TTFT and p99 TPOT at once):")
    print("\n".join(format_points(res.frontier, lambda p: "<- best within SLO" if p is res.best else "")))
    if res.best is None:
        print(f"no configuration meets the SLO {args.slo}")
    elif res.best not in res.frontier:
        print(f"best within SLO: {res.best['label']}")
    if args.plot:
        vary = "max_num_batched_tokens" if "max_num_batched_tokens" in grid else next(iter(grid))
        plot_sweep(res.points, Path(args.plot) / "tune.png", [k for k in grid if k != vary], vary, slo, res.best)
        print(f"plot: {Path(args.plot) / 'tune.png'}")
    verified = []
    if args.verify:
        real = EngineFactory()
        rated = with_request_rate(reqs, args.request_rate, args.seed)
        print(f"\nverifying the top {args.verify} on the real engine ({args.verify_model or 'embedded model'}):")
        for p in ranked_within_slo(res.points, slo)[:args.verify]:
            cfg = engine_config(config, model=args.verify_model, dtype=real_dtype, **{k: p[k] for k in grid})
            engine = real.engine(cfg)
            run_workload(engine, [replace(r, arrival_time=0.0) for r in rated[:4]], progress=False)  # warm-up
            m = run_workload(engine, rated, label=p["label"], progress=not args.no_progress).metrics
            d = m.to_dict()
            verified.append({"label": p["label"], "simulated": p, "real": d})
            print(f"{p['label']}: simulated {p['output_throughput']:.1f} tok/s, p99 TTFT {p['p99_ttft_ms']:.0f} ms, "
                  f"p99 TPOT {p['p99_tpot_ms']:.1f} ms | real {d['output_throughput']:.1f} tok/s, "
                  f"p99 TTFT {d['p99_ttft_ms']:.0f} ms, p99 TPOT {d['p99_tpot_ms']:.1f} ms")
    write_json(args.output_json, {"slo": slo, "grid": grid, "best": res.best,
                                  "frontier": [p["label"] for p in res.frontier], "skipped": res.skipped,
                                  "points": res.points, "verified": verified})
    return 0


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    from ferry.sim.hardware import PRESETS as HW
    from ferry.sim.models import PRESETS as MODELS

    g = p.add_argument_group("simulation (--model is a preset or a config.json: " + ", ".join(MODELS) + ")")
    g.add_argument("--hardware", default="h100-sxm", help=f"a preset ({', '.join(HW)}) or a calibrated profile JSON")
    g.add_argument("--spec-acceptance-rate", type=float, default=0.5,
                   help="with --speculative-config: the chance each draft token is accepted")


def add_sim_parsers(sub: Any, add_engine_args: Callable[..., None],
                    run: Callable[[Callable[[argparse.Namespace, EngineConfig], int]], Any]) -> None:
    from ferry.bench.commands import add_output_args, add_workload_args, parse_rate_arg
    from ferry.bench.batching_report import DEFAULT_MIXED
    from ferry.bench.sweep import SWEEPABLE
    from ferry.server.router import add_router_args

    p = sub.add_parser("simulate", help="the engine loop and scheduler on a cost model of a GPU (or of this machine)",
                       description="run (default): one workload in simulated time; calibrate: fit a profile of "
                                   "this machine; batching-report: the batching experiments at GPU scale; route: "
                                   "data-parallel "
                                   "replicas behind the router, one run per --policies.")
    p.add_argument("action", nargs="?", choices=("run", "calibrate", "batching-report", "route"))
    add_workload_args(p)
    p.add_argument("--request-rate", type=parse_rate_arg, default=None,
                   help="requests/s, Poisson (seeded by --seed); inf = all at once; default: the workload's own")
    p.add_argument("--num-runs", type=int, default=1, help=argparse.SUPPRESS)
    add_output_args(p)
    p.add_argument("--out", help="calibrate: the profile JSON to write; batching-report: the report directory")
    p.add_argument("--from-run", nargs="+", metavar="RUN.json",
                   help="calibrate: fit to the steps of these runs (ferry bench offline|online --output-json) "
                        "instead of timing synthetic step shapes")
    p.add_argument("--reps", type=int, default=3, help="calibrate: timed repetitions per step shape and pass")
    p.add_argument("--passes", type=int, default=2, help="calibrate: measuring passes over all shapes")
    p.add_argument("--samples-json", help="calibrate: also write the measured steps here")
    p.add_argument("--quick", action="store_true", help="batching-report: small sizes")
    p.add_argument("--no-plots", action="store_true", help="batching-report: tables only")
    p.add_argument("--only", default="abcdef", help="batching-report: which experiments, e.g. 'f' (default: all)")
    p.add_argument("--mixed-workload", default=str(DEFAULT_MIXED), help="batching-report: the mixed-lengths workload")
    add_router_args(p)
    g = p.add_argument_group("route (also --dp, --num-prompts (default 1000), --output-len, --request-rate, "
                             "or a --workload file)")
    g.add_argument("--policies", default=None, metavar="all|P,P",
                   help="route: the router policies to compare, comma-separated, or all (default: --router-policy)")
    g.add_argument("--num-groups", type=int, default=64, help="route: shared prefixes (system prompts)")
    g.add_argument("--prefix-len", type=int, default=2000, help="route: tokens of each shared prefix")
    g.add_argument("--suffix-len", type=int, default=200, help="route: unique tokens after the prefix")
    g.add_argument("--group-skew", type=float, default=0.0,
                   help="route: Zipf exponent of group popularity (0: uniform; 1: the top group of 64 gets ~21%%)")
    _add_sim_args(p)
    add_engine_args(p)
    p.set_defaults(func=run(cmd_simulate))

    p = sub.add_parser("tune", help="search max_num_batched_tokens, max_num_seqs and chunked prefill in "
                                    "simulation for the highest throughput within an SLO")
    add_workload_args(p)
    p.add_argument("--request-rate", type=parse_rate_arg, default=None, help="requests/s (Poisson); inf = all at once")
    p.add_argument("--slo", required=True, help="e.g. ttft_p99=2000,tpot_p99=100 (ms)")
    p.add_argument("--verify", type=int, default=0, metavar="N", help="run the best N on the real engine too")
    p.add_argument("--verify-model", default=None, help="the real model for --verify (default: the embedded one)")
    add_output_args(p)
    _add_sim_args(p)
    add_engine_args(p, lists=tuple(SWEEPABLE))
    p.set_defaults(func=run(cmd_tune))
