"""The one ``ferry`` command: generate, chat, demo, bench."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Callable

from ferry.bench.commands import add_bench_parsers
from ferry.config import EngineConfig
from ferry.extras import MissingExtraError, missing_extra
from ferry.sim.commands import add_sim_parsers

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
    "What does a compiler do?",
    "Suggest a name for a small red boat.",
    "Why do cats purr?",
    "Describe a ferry in one sentence.",
    "What is the boiling point of water in Celsius?",
    "List three fruits that are yellow.",
]


# Help for the engine settings whose flag alone does not say what they take.
ENGINE_HELP = {
    "model": "a model directory, a .gguf file, or a Hugging Face name ORG/NAME (a safetensors repository) "
             "or ORG/NAME:QUANT (that GGUF of a GGUF repository, e.g. :Q4_K_M; no tag: Q4_K_M, else Q8_0, "
             "else the first). A name is read from the Hugging Face cache (HF_HOME, HF_HUB_CACHE) and "
             "downloaded if it is not there, unless HF_HUB_OFFLINE=1; a local path of the same spelling "
             "wins. Default: the embedded SmolLM2-135M-Instruct",
    "speculative_config": "speculative decoding, as JSON (vLLM's form): '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' drafts by prompt lookup; "
                          "'{\"model\": DRAFT, \"num_speculative_tokens\": 4}' drafts with a smaller model of the "
                          "same vocabulary (a directory, .gguf or Hugging Face name; its KV shares the target's "
                          "blocks and --kv-cache-memory-gb). Optional: disable_by_batch_size (no drafts from that "
                          "many running requests); adaptive_k: true (each step, each request drafts 0 to "
                          "num_speculative_tokens tokens, as many as maximise expected tokens per unit of step "
                          "time from its measured acceptance rate; drafting stops where the batch is large), "
                          "with step_cost {\"target\": [[rows, time], ...], \"draft\": [...], \"verify\": [...]} "
                          "(measured step times the rule reads; defaults measured on a 2-core CPU). method \"mtp\": the model's own "
                          "MTP head drafts (Qwen3.5's mtp.* tensors; for a GGUF model, name llama.cpp's --mtp GGUF "
                          "as model)",
    "mmproj": "an image model's vision tower as llama.cpp's mmproj GGUF (convert_hf_to_gguf.py --mmproj), "
              "for a text GGUF --model (as llama-server's --mmproj). Default: the one mmproj-*.gguf beside the "
              "model file, when there is exactly one (or one whose name matches it)",
    "max_num_encoder_tokens": "image models: a step's vision-encoder budget in image tokens' worth of encoding; "
                              "an image larger than what is left is encoded over several steps (a share a "
                              "step), and a prompt chunk ends before an image whose encoding is not done. "
                              "Lower it to keep decoding requests' inter-token latency steady while images "
                              "arrive. Default: --max-num-batched-tokens",
    "num_state_slots": "models with recurrent layers (Qwen3.5, LFM2, Mamba2 hybrids): per-request state slots, "
                       "shared by running requests and the prefix cache's state snapshots. Default: two per "
                       "sequence within half of --kv-cache-memory-gb",
    "state_snapshot_interval": "models with recurrent layers: every how many tokens a request's state is kept "
                               "for the prefix cache (a multiple of --block-size; a prompt's last full block "
                               "is kept too). Default: 512 rounded up to a multiple of --block-size",
}


def add_engine_args(p: argparse.ArgumentParser, lists: tuple[str, ...] = (),
                    repeatable: dict[str, str] | None = None) -> None:
    """Every EngineConfig field as --kebab-case, with vLLM's names.

    Settings named in ``lists`` take comma-separated values (a sweep's grid), kept as text;
    they default to None, so a command can tell which ones were given. Those in ``repeatable``
    may be given several times (a list, None if never; the engine settings take the first), with
    that help added.
    """
    repeatable = repeatable or {}
    g = p.add_argument_group("engine settings" + (" (comma-separated lists allowed: "
                                                  + ", ".join(lists) + ")" if lists else ""))
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name in lists:
            g.add_argument(flag, dest=f.name, default=None, metavar="V1,V2,...")
        elif f.name in repeatable:
            g.add_argument(flag, dest=f.name, default=None, action="append", metavar=f.name.upper(),
                           help=f"{ENGINE_HELP.get(f.name, '')}. {repeatable[f.name]}")
        elif f.type in ("bool", bool) or isinstance(default, bool):
            g.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction)
        else:
            kind = _arg_type(f.type, default)
            g.add_argument(flag, dest=f.name, default=default, type=kind, metavar=f.name.upper(),
                           help=ENGINE_HELP.get(f.name))
    p.set_defaults(list_settings=lists, repeated_settings=tuple(repeatable))


def _arg_type(annotation: Any, default: Any):
    text = str(annotation)
    if "int" in text and "float" not in text:
        return int
    if "float" in text:
        return float
    return str


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    repeated = getattr(args, "repeated_settings", ())

    def value(name: str) -> Any:
        v = getattr(args, name)
        return (v[0] if v else None) if name in repeated else v

    return {f.name: value(f.name) for f in dataclasses.fields(EngineConfig)
            if f.name not in getattr(args, "list_settings", ())}


def with_engine_config(handler: Callable[[argparse.Namespace, EngineConfig], int]) -> Callable[[argparse.Namespace], int]:
    """Build the EngineConfig from the flags (list-valued ones that were given go to ``args.sweep``),
    then run."""
    def run(args: argparse.Namespace) -> int:
        args.sweep = {name: getattr(args, name) for name in args.list_settings if getattr(args, name) is not None}
        return handler(args, EngineConfig.from_kwargs(**engine_kwargs(args)))

    return run


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None,
                   help="per-request seed (the engine-wide one is --seed)")


def sampling_params(args: argparse.Namespace):
    from ferry import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from ferry import LLM

    llm = LLM(**engine_kwargs(args))
    outs = llm.generate(args.prompt, sampling_params(args), use_tqdm=False)
    for o in outs:
        print(o.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ferry.llm import LLM
    from ferry.model.tokenizer import apply_chat_template

    llm = LLM(**engine_kwargs(args))
    engine, sp = llm.engine, sampling_params(args)
    history: list[dict[str, str]] = []
    print("ferry chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        req = engine.add_request(apply_chat_template(llm.tokenizer, history), sp)
        text = ""
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == req.request_id:
                    new = out.outputs[0].text
                    print(new[len(text):], end="", flush=True)
                    text = new
        print()
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ferry import LLM, SamplingParams
    from ferry.engine.metrics import summarize

    llm = LLM(**engine_kwargs(args))
    print(f"model loaded in {llm.startup_seconds:.1f} s")
    convs = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    llm.engine.step_stats = []  # every step of the run
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    duration = time.perf_counter() - t0
    for q, o in zip(DEMO_QUESTIONS, outs):
        print(f"\n### {q}\n{o.outputs[0].text.strip()}  [{o.outputs[0].finish_reason}]")
    print("\n--- summary (continuous batching, all requests together) ---")
    print("\n".join(summarize(outs, duration, llm.engine.step_stats, llm.engine.num_kv_blocks).lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="complete one prompt")
    p.add_argument("prompt")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("demo", help="a batch of chat prompts on the embedded model, then a summary")
    p.add_argument("--max-tokens", type=int, default=128)
    add_engine_args(p)
    p.set_defaults(func=cmd_demo)
    add_bench_parsers(sub, add_engine_args, with_engine_config)
    add_sim_parsers(sub, add_engine_args, with_engine_config)
    add_serve_parser(sub)
    return parser


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``ferry serve``; without the server's packages, a command that says which extra to install."""
    help_text = "an OpenAI-compatible HTTP server"
    try:
        from ferry.server.serve import add_server_args, cmd_serve
    except ImportError as e:
        err = missing_extra(e, "ferry serve")
        if err is None:
            raise

        def refuse(args: argparse.Namespace) -> int:
            raise err

        p = sub.add_parser("serve", help=f"{help_text} (not installed: pip install 'ferry[server]')",
                           description=str(err))
        p.set_defaults(func=refuse, takes_any_arguments=True)
        return
    p = sub.add_parser("serve", help=help_text)
    add_server_args(p)
    add_engine_args(p, repeatable={"model": "Repeat it to serve several models (--model A --model B), "
                                            "each loaded on its first request, named as --models-dir names them"})
    p.set_defaults(func=with_engine_config(cmd_serve))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        # An optional package a command imported on the way: say which extra installs it.
        err = e if isinstance(e, MissingExtraError) else missing_extra(e)
        if err is None:
            raise
        print(f"ferry: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
