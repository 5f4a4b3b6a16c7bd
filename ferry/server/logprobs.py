"""Logprobs in the shapes OpenAI's and vLLM's clients read."""
from __future__ import annotations

from typing import Any

from ferry.engine.outputs import CompletionOutput


def completion_logprobs(prompt_ids: list[int], prompt_lps: list[dict[int, float] | None] | None,
                        comp: CompletionOutput, tokenizer: Any, start: int, offset: int) -> dict[str, Any] | None:
    """The completions API's ``logprobs``: the prompt's tokens first when given (echo; the first has
    none), then the output's tokens from ``start``; ``offset`` is the text offset of the first."""
    if tokenizer is None or (comp.logprobs is None and not prompt_lps):
        return None
    toks: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offs: list[int] = []
    pairs = list(zip(prompt_ids, prompt_lps or [])) + list(zip(comp.token_ids[start:], (comp.logprobs or [])[start:]))
    for tid, entry in pairs:
        piece = tokenizer.decode([tid], skip_special_tokens=False)
        toks.append(piece)
        lps.append(None if entry is None else entry.get(tid))
        tops.append(None if entry is None else {tokenizer.decode([k], skip_special_tokens=False): v
                                                for k, v in entry.items()})
        offs.append(offset)
        offset += len(piece)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(comp: CompletionOutput, tokenizer: Any, start: int, top: int) -> dict[str, Any] | None:
    """The chat API's ``logprobs``: each output token with its bytes and the ``top`` best."""
    if comp.logprobs is None or tokenizer is None:
        return None

    def item(tid: int, lp: float) -> dict[str, Any]:
        piece = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

    return {"content": [
        {**item(tid, entry[tid]), "top_logprobs": [item(k, v) for k, v in sorted(entry.items(), key=lambda kv: -kv[1])[:top]]}
        for tid, entry in zip(comp.token_ids[start:], comp.logprobs[start:])]}


def prompt_logprobs_json(prompt_ids: list[int], lps: list[dict[int, float] | None] | None,
                         tokenizer: Any) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else token id -> logprob
    and decoded token, for the prompt's own token and the top alternatives."""
    if lps is None:
        return None

    def decoded(tid: int) -> str | None:
        return tokenizer.decode([tid], skip_special_tokens=False) if tokenizer is not None else None

    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in lps:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": v, "decoded_token": decoded(t)} for t, v in entry.items()})
    return out
