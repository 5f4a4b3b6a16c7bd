"""Reading a call section's text as it comes, to send each call's arguments while they are written.

``CallScanner`` follows the JSON structure of the text (strings, objects, lists) one character at a
time and notes, for each call object in a call's place (the text itself, an element of a list, of
``{"tool_calls": [...]}`` or the object under a call's ``"function"``), the function's name and where
its arguments object starts and ends; Mistral's ``name[ARGS]{...}`` calls too. What it finds is
only a guide for streaming: the parser's ``read`` still decides what the whole section holds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ARGS_KEYS = ("arguments", "parameters")


@dataclass
class Found:
    """One call met in the text: its name once read, and its arguments' span (end None while open)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    done: bool = False  # its object (or arguments, for name[ARGS]) is closed
    end: int = 0  # just past it, once done
    args_key: str | None = None  # the member the arguments are read from ("arguments" or "parameters")
    # Every arguments member met, start -> end (None while open): a stream that sent "parameters"
    # before an "arguments" member replaced them finishes what it sent from here.
    spans: dict[int, int | None] = field(default_factory=dict)


@dataclass
class _Frame:
    """An open JSON container; for an object, where it is among its members."""

    kind: str  # "{" or "["
    role: str  # "call", "calls" (a list of calls), "args" (a name[ARGS] call's arguments), "other"
    key: str | None = None
    expect: str = "key"  # key -> colon -> value -> (in value) -> after
    key_start: int = 0
    value_start: int = 0
    found: Found | None = None


class CallScanner:
    """Feed a call section's text; ``found`` lists its calls in order, ``text`` holds it all."""

    def __init__(self, args_marker: str | None = None, separator: str | None = None) -> None:
        self.text = ""
        self.found: list[Found] = []
        self._i = 0
        self._stack: list[_Frame] = []
        self._in_str = False
        self._esc = False
        self._args_marker = args_marker  # Mistral's "[ARGS]": the name before it, the arguments after
        self._separator = separator  # Mistral's "[TOOL_CALLS]" before each later call
        self._named: bool | None = None  # a name[ARGS] section (decided at its first character)
        self._loose = ""  # text at the top, outside any JSON value

    def feed(self, text: str) -> None:
        self.text += text
        for k in range(self._i, len(self.text)):
            self._char(self.text[k], k)
        self._i = len(self.text)

    def finish(self) -> bool:
        """The section is whole (nothing to complete: its text is read as it comes)."""
        return True

    def arguments(self, f: Found, start: int = 0) -> str | None:
        """The arguments of ``f`` written so far, from character ``start``; None until they open as an object."""
        if f.args_start is None or self.text[f.args_start] != "{":
            return None
        return self.text[f.args_start + start:f.args_end if f.args_end is not None else len(self.text)]

    def _char(self, c: str, k: int) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                self._string_end(k)
            return
        if self._named is None and not c.isspace():
            self._named = self._args_marker is not None and c not in "{["
        top = self._stack[-1] if self._stack else None
        if top is None and self._named and c != "{":
            self._loose += c  # name[ARGS] text between calls, brackets included
            return
        if c == '"':
            self._in_str = True
            self._value_start(k, '"')
            if top is not None and top.kind == "{" and top.expect == "key":
                top.key_start = k
        elif c in "{[":
            role = self._value_start(k, c)
            self._stack.append(_Frame(c, role))
            if role == "args":
                self._stack[-1].found = self.found[-1]
        elif c in "}]":
            self._close(k)
        elif top is not None and top.kind == "{" and c == ":" and top.expect == "colon":
            top.expect = "value"
        elif top is not None and c == ",":
            self._scalar_end(top, k)
            top.expect = "key" if top.kind == "{" else "value"
        elif not c.isspace():
            self._value_start(k, c)

    def _value_start(self, k: int, c: str) -> str:
        """A value begins at ``k`` with ``c``: the role it takes if it is a container."""
        top = self._stack[-1] if self._stack else None
        if top is None:
            if self._named:
                name = self._loose.strip()
                self._loose = ""
                if self._separator:
                    name = name.removeprefix(self._separator).strip()
                if self._args_marker and name.endswith(self._args_marker):
                    self.found.append(Found(name[:-len(self._args_marker)].strip(), args_start=k))
                    return "args"
                return "other"
            return "call" if c == "{" else "calls" if c == "[" else "other"
        if top.kind == "[":
            return "call" if top.role == "calls" and c == "{" else "other"
        if top.expect != "value":
            return "other"  # a key's string, or text out of place
        top.expect, top.value_start = "in", k
        role = "other"
        if top.role == "call":
            if top.key in ("name", *ARGS_KEYS) and top.found is None:
                top.found = Found()
                self.found.append(top.found)
            if top.key in ARGS_KEYS:
                self._args_start(top.found, top.key, k)
            elif top.key == "tool_calls" and c == "[":
                role = "calls"
            elif top.key == "function" and c == "{":
                role = "call"
        return role

    @staticmethod
    def _args_start(f: Found, key: str, k: int) -> None:
        """A call's arguments member opens at ``k``: "arguments" wins over "parameters" wherever
        each stands, as ``call_from_json`` reads them."""
        f.spans[k] = None
        if f.args_key is None or (key == "arguments" and f.args_key == "parameters"):
            f.args_key, f.args_start, f.args_end = key, k, None

    def _string_end(self, k: int) -> None:
        top = self._stack[-1] if self._stack else None
        if top is None or top.kind != "{":
            return
        if top.expect == "key":
            try:
                top.key = json.loads(self.text[top.key_start:k + 1])
            except json.JSONDecodeError:
                top.key = None
            top.expect = "colon"
        elif top.expect == "in":
            self._value_end(top, k + 1)

    def _scalar_end(self, top: _Frame, k: int) -> None:
        if top.kind == "{" and top.expect == "in":
            self._value_end(top, k)

    def _value_end(self, frame: _Frame, end: int) -> None:
        frame.expect = "after"
        f = frame.found
        if f is None or frame.role != "call":
            return
        raw = self.text[frame.value_start:end].strip()
        if frame.key == "name":
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                name = None
            f.name = name if isinstance(name, str) else None
        elif frame.key in ARGS_KEYS and frame.value_start in f.spans:
            f.spans[frame.value_start] = frame.value_start + len(raw)
            if frame.value_start == f.args_start:
                f.args_end = f.spans[frame.value_start]

    def _close(self, k: int) -> None:
        if not self._stack:
            return
        frame = self._stack.pop()
        self._scalar_end(frame, k)
        if frame.found is not None and frame.role in ("call", "args"):
            if frame.role == "args":
                frame.found.args_end = k + 1
            frame.found.done, frame.found.end = True, k + 1
        parent = self._stack[-1] if self._stack else None
        if parent is not None and parent.kind == "{" and parent.expect == "in":
            self._value_end(parent, k + 1)


class ObjectEnd:
    """Where the JSON object opening a growing text closes (strings and nesting followed), read on
    from where the last look stopped."""

    def __init__(self) -> None:
        self._depth, self._in_str, self._esc, self._pos = 0, False, False, 0
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The index just past the object; None while it is not closed."""
        for k in range(self._pos, len(text) if self.end is None else 0):
            c = text[k]
            if self._in_str:
                self._esc, self._in_str = (False, True) if self._esc else (c == "\\", c != '"')
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = k + 1
                    break
        self._pos = len(text)
        return self.end
