"""A second chat turn over a long shared history: its first token cold against after the first turn.

The first turn's prompt is ``--history`` tokens; it generates ``--answer`` tokens; the second turn's
prompt is that history, the answer and ``--new`` more tokens. Cold: the second turn alone, on an
empty prefix cache. Warm: after the first turn, whose blocks (and, for models with recurrent layers,
state snapshots) the second turn resumes from. Prints the median of ``--runs`` of each.

    python benchmarks/second_turn.py --model model.gguf --history 2000
"""
from __future__ import annotations

import argparse
import statistics

from ferry import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args()
    llm = LLM(model=args.model, max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True)
    vocab = llm.engine.executor.vocab_size or 32000
    history = [(7 * i + 11) % (vocab - 10) + 5 for i in range(args.history)]
    greedy = SamplingParams(temperature=0, max_tokens=args.answer, min_tokens=args.answer)
    one = SamplingParams(temperature=0, max_tokens=1)
    cold, warm = [], []
    for _ in range(args.runs):
        llm.engine.reset_prefix_cache()
        answer = llm.generate([history], greedy, use_tqdm=False)[0].outputs[0].token_ids
        second = history + list(answer) + [(13 * i + 3) % (vocab - 10) + 5 for i in range(args.new)]
        warm.append(llm.generate([second], one, use_tqdm=False)[0].metrics.ttft)
        llm.engine.reset_prefix_cache()
        cold.append(llm.generate([second], one, use_tqdm=False)[0].metrics.ttft)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"second turn of {len(second)} tokens: first token cold {c:.3f} s, after the first turn {w:.3f} s "
          f"({c / w:.1f}x sooner)")


if __name__ == "__main__":
    main()
