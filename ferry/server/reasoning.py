"""Reasoning parsers (``--reasoning-parser``): a thinking model's ``<think>...</think>`` text is split
from its answer, whole or as it streams, and sent as ``reasoning_content`` (and ``reasoning``)."""
from __future__ import annotations

from dataclasses import dataclass

from ferry.server.tools.parsers.base import partial_suffix


@dataclass(frozen=True)
class ReasoningParser:
    """``starts_inside``: the template opens the think block in the prompt (DeepSeek-R1's), so the
    output starts in reasoning; otherwise reasoning only when the output opens with ``start``."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False


REASONING_PARSERS = {p.name: p for p in (
    ReasoningParser("qwen3"), ReasoningParser("think"), ReasoningParser("deepseek_r1", starts_inside=True))}


class ReasoningStream:
    """Feed a choice's text; get back (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.state = "inside" if parser.starts_inside else "start"  # start -> inside -> after
        self.pending = ""
        self.saw = parser.starts_inside  # a think block was opened
        self.fresh = True  # nothing fed yet
        self.strip_newlines = False

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while True:
            if self.state == "start":
                s = self.pending.lstrip()
                if s.startswith(self.p.start):
                    self.pending, self.state, self.saw = s[len(self.p.start):], "inside", True
                    continue
                if not finished and self.p.start.startswith(s):
                    break  # "<thi": not decided yet
                self.state = "after"
                continue
            if self.state == "inside":
                if self.fresh and self.p.starts_inside:  # the model may write the opening tag again
                    s = self.pending.lstrip()
                    if s.startswith(self.p.start):
                        self.pending = s[len(self.p.start):]
                    elif not finished and self.p.start.startswith(s):
                        break  # "<thi": not decided yet
                self.fresh = False
                i = self.pending.find(self.p.end)
                if i >= 0:
                    reasoning.append(self.pending[:i])
                    self.pending, self.state = self.pending[i + len(self.p.end):], "after"
                    self.strip_newlines = True  # templates put "\n\n" between the think block and the answer
                    continue
                keep = 0 if finished else partial_suffix(self.pending, self.p.end)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            if self.strip_newlines:
                self.pending = self.pending.lstrip("\n")
                self.strip_newlines = not self.pending
            content.append(self.pending)
            self.pending = ""
            break
        return "".join(reasoning), "".join(content)

    def whole(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        r, c = self.feed(text, finished=True)
        return (r if self.saw else None), c

