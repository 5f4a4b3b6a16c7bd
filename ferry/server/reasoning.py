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
    ReasoningParser("qwen3"), ReasoningParser("think"), ReasoningParser("deepseek_r1", starts_inside=True),
    # gpt-oss: the chat routes read harmony's channels with ferry.server.harmony, not these markers.
    ReasoningParser("harmony", "<|channel|>analysis<|message|>", "<|end|>"))}


def prompt_opens(parser: ReasoningParser, prompt: str) -> bool:
    """Whether ``prompt`` (its end is enough) leaves a think block open for the output: templates of
    Qwen3.5, QwQ and other thinking models end the generation prompt with ``<think>\n``."""
    i = prompt.rfind(parser.start)
    return i >= 0 and not prompt[i + len(parser.start):].strip()


class ReasoningStream:
    """Feed a choice's text; get back (reasoning delta, content delta); ``whole`` reads the text at
    once with the same rules, so the two agree however the text is split.

    ``opened``: whether the prompt opened the think block (``prompt_opens``): True, the output starts
    in reasoning; False, it is reasoning only when it opens with ``<think>``. None (the prompt is not
    known): a lone ``</think>`` (no ``<think>`` before it) ending within the first ``LONE_END_WITHIN``
    characters closes a block the template opened, and the text before it is reasoning (as vLLM's
    qwen3 reads it); the stream holds that much text back until it can tell."""

    LONE_END_WITHIN = 4096  # how far a lone </think> is looked for (and text held back), in characters

    def __init__(self, parser: ReasoningParser, opened: bool | None = None) -> None:
        self.p = parser
        self.inside_first = parser.starts_inside or bool(opened)
        self.lone_end = opened is None and not self.inside_first  # the lone </think> rule applies
        self.state = "inside" if self.inside_first else "start"  # start -> inside -> after
        self.pending = ""
        self.saw = self.inside_first  # a think block was opened
        self.fresh = True  # nothing fed yet
        self.strip_newlines = False

    @property
    def done(self) -> bool:
        """The think block is over (or there was none): nothing more is reasoning."""
        return self.state == "after"

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
                lone = self._lone_end(finished)
                if lone is None:
                    break  # held back until a lone </think> can be told
                self.state, self.saw = ("inside", True) if lone else ("after", self.saw)
                continue
            if self.state == "inside":
                if self.fresh and self.inside_first:  # the model may write the opening tag again
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

    def _lone_end(self, finished: bool) -> bool | None:
        """Whether the output not opening with ``<think>`` closes the block with a lone ``</think>``
        (always False unless ``lone_end``); None while that cannot be told yet."""
        if not self.lone_end:
            return False
        window = self.pending[:self.LONE_END_WITHIN]
        end, start = window.find(self.p.end), window.find(self.p.start)
        if end >= 0 and (start < 0 or end < start):
            return True
        if start >= 0 or finished or len(self.pending) >= self.LONE_END_WITHIN:
            return False
        return None

    def whole(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output, read as ``feed`` reads it."""
        r, c = self.feed(text, finished=True)
        return (r if self.saw else None), c

