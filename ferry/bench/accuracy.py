"""``ferry bench accuracy``: what a faster setting costs in accuracy, against the exact engine.

Both engines score the same fixed texts (prompt logprobs): at every position, does the most likely
next token agree (top-1 agreement), and by how much does the logprob of the actual next token
differ (mean and max absolute difference, in nats)? With a text file it also gives both engines' perplexity
computed as llama-perplexity does, to set beside llama.cpp's on the same file and text.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ferry.config import EngineConfig

# Fixed texts of different kinds (prose, code, a list, numbers, dialogue), ~1000 tokens in all.
TEXTS = (
    "The ferry left the harbour at dawn, its engines humming as gulls circled overhead. Passengers "
    "gathered on the deck to watch the coastline fade into a pale blue haze, and a child pointed at a "
    "pod of dolphins racing alongside the hull. The captain checked the charts once more: the crossing "
    "would take four hours if the wind held, longer if the storm to the south moved north.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left, right = merge_sort(items[:mid]), merge_sort(items[mid:])\n    out = []\n"
    "    while left and right:\n        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return out + left + right\n",
    "Shopping list for the week: two loaves of bread, a dozen eggs, olive oil, three onions, garlic, "
    "a bag of rice, tomatoes, fresh basil, parmesan, coffee beans, oat milk and a jar of honey.",
    "In 1969 the population of the town was 12,450; by 1989 it had grown to 18,730 and by 2009 to "
    "26,115. The average annual growth over those forty years was therefore about 1.9 percent.",
    "User: Can you explain what a prime number is?\nAssistant: A prime number is a whole number greater "
    "than one whose only divisors are one and itself. The first few are 2, 3, 5, 7, 11 and 13. Euclid "
    "proved there are infinitely many of them.\nUser: Why is one not prime?\nAssistant:",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, chlorophyll absorbs "
    "light, water is split into oxygen, protons and electrons, and the energy carried by those electrons "
    "is used to fix carbon dioxide into sugars through the Calvin cycle.",
)


def compare(exact: Any, other: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Top-1 agreement and logprob differences of ``other`` against ``exact`` (two ferry.LLM)."""
    from ferry import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    a = exact.generate(prompts, sp, use_tqdm=False)
    b = other.generate(prompts, sp, use_tqdm=False)
    agree = positions = 0
    diffs: list[float] = []
    for oa, ob, ids in zip(a, b, prompts):
        for pos, (ea, eb) in enumerate(zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:]), start=1):
            tok = ids[pos]
            diffs.append(abs(ea[tok] - eb[tok]))
            agree += max(ea, key=ea.get) == max(eb, key=eb.get)
            positions += 1
    return {"positions": positions, "top1_agreement": agree / positions,
            "mean_abs_logprob_diff": sum(diffs) / positions, "max_abs_logprob_diff": max(diffs)}


def perplexity(llm: Any, tokens: list[int], n_ctx: int = 512) -> dict[str, Any]:
    """Perplexity as llama-perplexity computes it, so the two compare on the same file and text:
    the tokens in whole chunks of ``n_ctx``, each scored on its second half (the first half is
    context), the chunk's first token replaced by BOS when the tokenizer adds one."""
    import math

    from ferry import SamplingParams

    bos = llm.tokenizer.bos_token_id if getattr(llm.tokenizer, "add_bos_token", False) else None
    chunks = [tokens[i:i + n_ctx] for i in range(0, len(tokens) - n_ctx + 1, n_ctx)]
    if not chunks:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}")
    if bos is not None:
        chunks = [[bos] + c[1:] for c in chunks]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    nll, scored = 0.0, 0
    for out, ids in zip(llm.generate(chunks, sp, use_tqdm=False), chunks):
        for j in range(n_ctx // 2 + 1, n_ctx):
            nll -= out.prompt_logprobs[j][ids[j]]
            scored += 1
    return {"chunks": len(chunks), "n_ctx": n_ctx, "scored": scored, "perplexity": math.exp(nll / scored)}


def run_accuracy(config: EngineConfig, text: str | None = None, n_ctx: int = 512) -> dict[str, Any]:
    """``config`` against the exact engine: the same model, float32 products, GGUF kept quantized
    (bit for bit the dequantized float32 model) where the model is a GGUF."""
    from ferry import LLM

    exact_cfg = replace(config, fp32_matmul_precision="ieee", dtype="float32", quantization=None,
                        quant_activations="exact", kv_cache_dtype="auto")
    exact, other = LLM(**vars(exact_cfg)), LLM(**vars(config))
    prompts = [exact.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    report = {"settings": {"dtype": config.dtype, "quantization": config.quantization,
                           "quant_activations": config.quant_activations,
                           "fp32_matmul_precision": config.fp32_matmul_precision,
                           "kv_cache_dtype": config.kv_cache_dtype},
              **compare(exact, other, prompts)}
    if text is not None:
        tokens = exact.tokenizer.encode(text, add_special_tokens=False)
        report["perplexity"] = {"tokens": len(tokens), "exact": perplexity(exact, tokens, n_ctx),
                                "these settings": perplexity(other, tokens, n_ctx)}
    return report
