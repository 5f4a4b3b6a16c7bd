"""Draft tokens by n-gram prompt lookup: no second model, just the request's own tokens."""
from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the request's last n tokens,
    trying the longest n in ``[min_n, max_n]`` first (a longer match predicts better). Of the
    occurrences, the latest with ``k`` tokens after it (recent text is the likeliest to be
    repeated next; in text that repeats with a short period the very latest is followed by
    fewer), else the latest. Empty when no n-gram recurs."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n:]
        first = suffix[0]
        latest = -1
        for i in range(end - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == suffix:
                if i + n + k <= end:
                    return tokens[i + n:i + n + k]
                if latest < 0:
                    latest = i
        if latest >= 0:
            return tokens[latest + n:latest + n + k]
    return []
