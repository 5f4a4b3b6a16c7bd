"""What every tool-call parser shares: the registry, whole-text extraction and streaming."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ferry.server.tools.calls import ToolCall, call_from_json
from ferry.server.tools.parsers.scan import CallScanner, ObjectEnd

PARSERS: dict[str, "ToolParser"] = {}


@dataclass(frozen=True)
class ToolParser:
    """One output format. ``start`` opens a call (None: a call only at the start of the output, after
    ``prefixes`` if any); ``end`` closes one (None: the call runs to the end of the output)."""

    name: str
    start: str | None
    end: str | None
    read: Callable[[str, set[str] | None], list[ToolCall] | None]  # the calls in a body, None if malformed
    template_marks: tuple[str, ...] = ()  # a chat template holding one of these speaks this format
    leads: tuple[str, ...] = ("{", "[")  # with start None: how the output must begin to be a call
    special_markers: bool = False  # the markers are special tokens: the text must keep them
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse others)
    # How one call is written, for a structural tag under tool_choice auto: (the text that opens a
    # call, its opening up to the arguments with {name} for the function's JSON-quoted name, what
    # follows the arguments). None: the format has no plain-text marker to trigger on.
    call_frame: tuple[str, str, str] | None = None
    args_marker: str | None = None  # Mistral's "[ARGS]": a call is written name[ARGS]{...}
    # A format that is not JSON (Qwen3's XML): builds the scanner of a call section (``scan.py``'s
    # ``CallScanner`` otherwise) from the offered functions' parameter schemas, which its ``read``
    # takes as a third argument (the values it reads are typed by them).
    scanner: Callable[[dict[str, Any] | None], Any] | None = None
    # A call written without the opening marker: the character that opens it and what follows that
    # (past whitespace), and what finds where it ends (``scan(text)``: the index past it, None while open).
    bare_lead: tuple[str, str] = ("{", '"name"')
    bare_end: Callable[[], Any] = ObjectEnd


def register(parser: ToolParser) -> ToolParser:
    PARSERS[parser.name] = parser
    return parser


def parser_for_template(template: str) -> ToolParser:
    """The format a chat template speaks, from the markers it writes; generic JSON otherwise."""
    for p in PARSERS.values():
        if any(m in template for m in p.template_marks):
            return p
    return PARSERS["generic_json"]


def read_json_calls(body: str, names: set[str] | None) -> list[ToolCall] | None:
    """Calls from JSON: one call object, a list of them, or {"tool_calls": [...]}."""
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        obj = obj["tool_calls"]
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(o.get("function", o) if isinstance(o, dict) else o, names) for o in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def extract(parser: ToolParser, text: str, names: set[str] | None = None,
            schemas: dict[str, Any] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output; a malformed call stays in the content as text."""
    stream = ToolStream(parser, names, schemas)
    content, calls = stream.feed(text, finished=True)
    return content, calls


@dataclass
class _Section:
    """A call section being read: its scanner, the marker that opened it, and the calls already sent
    as [found, call, how far its arguments were sent, where the arguments it follows start]."""

    scanner: Any  # a CallScanner, or the parser's own (ToolParser.scanner): the same reading API
    opened: str
    sent: list[list[Any]] = field(default_factory=list)


# A call is sent as (call, True, its arguments so far) when it starts, then (call, False, more arguments).
CallEvent = tuple[ToolCall, bool, str]
# What a stream gave back, in the order written: a piece of content, or a call event.
Part = str | CallEvent


class ToolStream:
    """A choice's output fed as it comes: what is content is given back as soon as it cannot be the
    start of a call; a call's name and arguments go out as they are written (``take_events``), and
    the call is given back whole once it is closed (or the output ends).

    A call the model wrote without the opening marker (``{"name": ...}</tool_call>``) is taken when
    the object names an offered function and the closing marker follows it.

    A section's calls, at its close (the closing marker, or the end of the output), whether it was
    fed whole or in pieces split anywhere: the calls the parser reads in the whole section; if it
    reads none, what a stream sends, in order: each call already sent (its arguments completed as
    written), then each further call that names an offered function with arguments closed as a JSON
    object, up to the first that does not; the text after the last of them (once its object is
    closed) is content. A section of which no call is taken is content as written. So a stream and
    the whole text agree, except where a stream sent a call that the whole text does not give (its
    arguments cut or broken after they began, or "parameters" that went out before an "arguments"
    member replaced them): sent, it cannot be taken back, and it stands as written."""

    def __init__(self, parser: ToolParser, names: set[str] | None = None,
                 schemas: dict[str, Any] | None = None) -> None:
        self.parser, self.names = parser, names
        self.schemas = schemas  # function name -> its parameters' JSON schema, for a parser that types values
        self.pending = ""  # text not yet given back: a possible marker's start, or a call's body
        self.section: _Section | None = None  # the call section being read
        self.at_start = True  # nothing but whitespace seen yet
        self.parts: list[Part] = []  # content and call events not yet taken, in order
        self._held: Any = None  # where the call held back at the start of pending ends (bare_end), read so far

    @property
    def in_call(self) -> bool:
        return self.section is not None

    def take_events(self) -> list[CallEvent]:
        """The call starts and argument pieces since the last take, in order."""
        return [p for p in self.take_parts() if not isinstance(p, str)]

    def take_parts(self) -> list[Part]:
        """The content pieces and call events since the last take, in the order they were written."""
        parts, self.parts = self.parts, []
        return parts

    def _say(self, content: list[str], text: str) -> None:
        """``text`` is content."""
        if text:
            content.append(text)
            self.parts.append(text)

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ToolCall]]:
        """Content and calls completed by ``text``; with ``finished``, everything left."""
        self.pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        p = self.parser
        while True:
            if self.section is not None:
                end = self.pending.find(p.end) if p.end else -1
                if end < 0 and not finished:
                    keep = partial_suffix(self.pending, p.end) if p.end else 0
                    self.section.scanner.feed(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    self._send_arguments(self.section)
                    break
                cut = end if end >= 0 else len(self.pending)
                closing = p.end if end >= 0 and p.end else ""
                self.section.scanner.feed(self.pending[:cut])
                self.pending = self.pending[cut + len(closing):]
                self._close(closing, content, calls)
                continue
            if p.start is None:
                if not self.at_start:
                    self._say(content, self.pending)
                    self.pending = ""
                    break
                s = self.pending.lstrip()
                if not s and not finished:
                    break
                if any(s.startswith(lead) for lead in p.leads):
                    self.pending, self.at_start = s, False
                    self._open("")
                    continue
                if not finished and any(lead.startswith(s) for lead in p.leads):
                    break  # e.g. "<|python" of "<|python_tag|>": not decided yet
                self.at_start = False
                continue
            i = self.pending.find(p.start)
            j = self._bare_start(i) if p.end else None
            if j != 0:
                self._held = None  # pending no longer opens with the object read so far
            if j is not None:
                self._say(content, self.pending[:j])
                self.pending = self.pending[j:]
                if not self._bare(finished, content, calls):
                    break  # not decided yet: held back
                self._held = None
                continue
            if i >= 0:
                self._say(content, self.pending[:i])
                self.pending = self.pending[i + len(p.start):]
                self._open(p.start)
                continue
            keep = 0 if finished else partial_suffix(self.pending, p.start)
            self._say(content, self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return "".join(content), calls

    def _open(self, marker: str) -> None:
        p = self.parser
        scanner = p.scanner(self.schemas) if p.scanner is not None \
            else CallScanner(p.args_marker, p.start if p.args_marker else None)
        self.section = _Section(scanner, marker)

    def _read(self, body: str) -> list[ToolCall] | None:
        """The calls in a section's text read whole by the parser (with the schemas, for one that types values)."""
        p = self.parser
        return p.read(body, self.names) if p.scanner is None else p.read(body, self.names, self.schemas)

    def _new_call(self, call: ToolCall) -> ToolCall:
        if self.parser.short_ids:
            call.id = uuid.uuid4().hex[:9]
        self.parts.append((call, True, call.arguments))
        return call

    def _more(self, call: ToolCall, text: str) -> None:
        if text:
            call.arguments += text
            self.parts.append((call, False, text))

    def _send_arguments(self, s: _Section, whole: bool = False) -> None:
        """Send what is written of a section's calls: a call starts once its offered name is read and
        its arguments object opens (``whole``: once they are closed and read as a JSON object, at the
        close of a section the parser did not read); its arguments go out as they come. Calls go in
        order: one that cannot be sent (a name not offered, arguments not an object) holds back those after it."""
        scanner, found = s.scanner, s.scanner.found
        while True:
            if s.sent:
                entry = s.sent[-1]
                more, closed = self._written(scanner, entry)
                self._more(entry[1], more)
                entry[2] += len(more)
                if not closed:
                    return
            if len(s.sent) == len(found):
                return
            f = found[len(s.sent)]
            args = scanner.arguments(f)
            if f.name is None or args is None or (self.names is not None and f.name not in self.names) \
                    or (whole and (f.args_end is None or not _json_object(args))):
                return
            s.sent.append([f, self._new_call(ToolCall(f.name, "")), 0, f.args_start])

    @staticmethod
    def _written(scanner: Any, entry: list[Any]) -> tuple[str, bool]:
        """(what is written of a sent call's arguments past what went out, whether they are closed),
        from the member it followed (a later "arguments" may have replaced the "parameters" it sent)."""
        f, _, upto, start = entry
        if start == f.args_start:
            return scanner.arguments(f, upto) or "", f.args_end is not None
        end = f.spans[start]
        return scanner.text[start + upto:len(scanner.text) if end is None else end], end is not None

    def _close(self, closing: str, content: list[str], calls: list[ToolCall]) -> None:
        """The section ends: its calls (the rule in the class's docstring)."""
        s = self.section
        assert s is not None
        self.section = None
        s.scanner.finish()
        body = s.scanner.text
        found = self._read(body.strip())
        if found is None:
            self._send_arguments(s, whole=True)  # what a stream split anywhere has sent by now
        if found is None and not s.sent:
            self._say(content, s.opened + body + closing)
            return
        for entry in s.sent:
            self._more(entry[1], self._written(s.scanner, entry)[0])
            calls.append(entry[1])
        if found is None:
            last = s.sent[-1][0]
            if last.done and body[last.end:].strip():  # text after the calls sent: the model's own
                self._say(content, body[last.end:])
            return
        calls += [self._new_call(c) for c in found[len(s.sent):]]

    def _bare_start(self, limit: int) -> int | None:
        """Where a call written without its opening marker may start (an object opening with
        ``"name"``), before ``limit`` (a marker's place, or -1 for none)."""
        lead, follows = self.parser.bare_lead
        text = self.pending if limit < 0 else self.pending[:limit]
        j = text.find(lead)
        while j >= 0:
            after = self.pending[j + len(lead):j + len(lead) + 64]  # a look at what follows is enough
            s = after.lstrip()
            if s.startswith(follows) or (follows.startswith(s) and j + len(lead) + 64 >= len(self.pending)):
                return j
            j = text.find(lead, j + 1)
        return None

    def _bare(self, finished: bool, content: list[str], calls: list[ToolCall]) -> bool:
        """The held text opens an object that may be a call missing its opening marker: taken when it
        closes, the closing marker follows and it reads as calls to offered functions; otherwise
        given back as content. False while that cannot be told yet."""
        p, text = self.parser, self.pending
        assert p.start is not None and p.end is not None
        if self._held is None:
            self._held = p.bare_end()
        end = self._held.scan(text)
        if end is None and not finished and p.start not in text:
            return False
        rest = text[end:].lstrip() if end is not None else ""
        if end is not None and rest.startswith(p.end):
            stop = len(text) - len(rest) + len(p.end)
            found = self._read(text[:end])
            if found is None:
                self._say(content, text[:stop])
            else:
                calls += [self._new_call(c) for c in found]
            self.pending = text[stop:]
            return True
        if end is not None and not finished and p.end.startswith(rest):
            return False
        cut = end if end is not None else 1  # not a call: the object (or its brace) is content
        self._say(content, text[:cut])
        self.pending = text[cut:]
        return True


def _json_object(text: str) -> bool:
    """Whether ``text`` reads as a JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
