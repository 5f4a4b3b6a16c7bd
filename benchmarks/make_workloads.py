"""Write the prefix-caching and speculative-decoding workloads into benchmarks/workloads/.

    .venv/bin/python benchmarks/make_workloads.py

shared-prefix-64.json: 16 chat conversations of 4 turns (64 requests) that all start with the
same 600-token system prompt; turn t repeats the conversation so far (earlier user and
assistant messages) before its new question; Poisson arrivals at 1 request/s, a conversation's
turns in order. Random token ids: the content of a prefix does not matter to the cache.

rewrite-16.json: 16 chat requests "repeat this paragraph exactly" on the embedded model's chat
template; the answer copies the prompt, where n-gram lookup drafts well.
"""
from __future__ import annotations

import random
from pathlib import Path

from ferry.bench.workload import WorkloadRequest, poisson_arrivals, save_workload

OUT = Path(__file__).parent / "workloads"
PARAGRAPHS = [
    "The ferry left the harbour at dawn, its engines humming as gulls circled overhead.",
    "Passengers gathered on the deck to watch the coastline fade into a pale blue haze.",
    "A child pointed at a pod of dolphins racing alongside the hull.",
    "In the galley, the cook set out bread, cheese and strong coffee for the early travellers.",
    "By noon the wind had freshened and spray drifted over the bow in fine white veils.",
    "The captain checked the charts twice before turning north toward the island.",
    "Every seat on the upper deck was taken by people reading, dozing or watching the sea.",
    "When the island finally appeared, it rose from the water like a green and grey whale.",
    "The harbour master waved the ferry in, and ropes flew across the narrowing gap.",
    "Cars rolled off the lower deck one by one while the crew shouted directions.",
    "A light rain began to fall as the last passengers hurried up the wooden pier.",
    "That evening the ferry sailed back empty, its lights reflected in the calm black water.",
]


def shared_prefix(vocab: int = 49152, conversations: int = 16, turns: int = 4, system_len: int = 600,
                  rate: float = 1.0, max_tokens: int = 32, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))]

    system = text(system_len, system_len)
    history = [list(system) for _ in range(conversations)]
    arrivals = poisson_arrivals(conversations * turns, rate, seed)
    out = []
    for i, t in enumerate(arrivals):  # in time order: every conversation's turn 0, then turn 1, ...
        c = i % conversations
        history[c] += text(20, 40)  # the user's new message
        out.append(WorkloadRequest(list(history[c]), max_tokens, arrival_time=t))
        history[c] += text(40, 80)  # the assistant's reply, as the next turn will send it back
    return out


def rewrite(n: int = 16, seed: int = 0) -> list[WorkloadRequest]:
    from ferry.model.loader import resolve_model_dir
    from ferry.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_dir(None, None))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(len(PARAGRAPHS))
        para = " ".join(PARAGRAPHS[start:start + rng.randint(2, 4)])
        ids = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{para}"}])
        answer = len(tok.encode(para, add_special_tokens=False))
        out.append(WorkloadRequest(ids, answer + 8))
    return out


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, reqs in (("shared-prefix-64", shared_prefix()), ("rewrite-16", rewrite())):
        save_workload(reqs, OUT / f"{name}.json")
        lens = [len(r.prompt_token_ids) for r in reqs]
        print(f"{name}: {len(reqs)} requests, prompts {min(lens)}-{max(lens)} tokens")
