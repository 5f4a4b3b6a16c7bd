"""Qwen3.5 / Qwen3.6 / Qwen3-Coder: each call is XML inside ``<tool_call>``, one parameter a tag::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is text: the one line break after its opening tag and the one before ``</parameter>`` are
the template's, and the rest is typed by the tool's JSON schema for that parameter (as vLLM's
``qwen3_coder`` parser does): a string stays as written, another type is read as JSON (the text
itself when it does not parse). The arguments go out as a JSON object as the values complete, a
string's characters as they come.

No structural tag constrains a call under tool_choice auto (``call_frame`` None): the existing one
holds JSON arguments after a JSON-quoted name, not parameter tags.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferry.server.tools.calls import ToolCall
from ferry.server.tools.parsers.base import PARSERS, ToolParser, partial_suffix, register
from ferry.server.tools.parsers.scan import Found

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def value_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows, from ``type`` and its ``anyOf``/``oneOf`` (empty: not said)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():
            types |= value_types(sub)
    return types


def is_text(types: set[str]) -> bool:
    """A value that stays the text written: a string, or a parameter whose type is not said."""
    return not types or "string" in types


def typed_value(text: str, types: set[str]) -> Any:
    """A non-string value read as JSON (``True``/``False`` taken for booleans); the text when it does not parse."""
    s = text.strip()
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        value = json.loads(s)
        json.dumps(value, allow_nan=False)  # NaN or 1e400 would make the arguments invalid JSON
        return value
    except ValueError:
        return text


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class XmlFound(Found):
    """A call met in the section, with its arguments as JSON as far as they are written."""

    args: str = ""
    params: int = 0  # parameters completed (a comma goes before the next one)


class XmlScanner:
    """Reads a call section's XML as it grows: ``found`` lists its calls, each with its arguments
    as JSON text that only grows (``arguments``); ``broken`` once the text is not the format.
    A value ends at the first ``</parameter>``; a call's ``</function>`` may be missing at the end."""

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        self.text = ""
        self.found: list[XmlFound] = []
        self.broken = False
        self._schemas = schemas or {}
        self._state = "top"  # top -> name -> params <-> key -> value -> params ... -> top
        self._i = 0  # where reading goes on
        self._tag = 0  # where the name being read starts
        self._properties: dict[str, Any] = {}  # the open call's parameter schemas
        self._types: set[str] = set()  # the open value's types
        self._value = 0  # where the open value starts (past its leading line break, once known)
        self._opened = False  # the open string value's quote went out
        self._sent = 0  # characters of the open string value that went out

    def feed(self, text: str) -> None:
        self.text += text
        while not self.broken and self._step():
            pass

    def finish(self) -> bool:
        """The section is whole: a call left open after its parameters is closed (its ``</function>``
        missing); False if the text is broken, or cut short in a value. Whatever the text, the last
        call's arguments are closed as written, so what went out of them is JSON."""
        if not self.broken and self._state == "value":
            self._end_value(len(self.text))
            self.broken = True
        if not self.broken and self._state == "params":
            self._close_call(len(self.text), len(self.text))
        if self._state != "top" or self.text[self._i:].strip():
            self.broken = True
        last = self.found[-1] if self.found else None
        if last is not None and last.args_end is None:
            last.args += "}"
            last.args_end = len(self.text)
        return not self.broken

    def arguments(self, f: Found, start: int = 0) -> str | None:
        """The arguments of ``f`` written so far, from character ``start``."""
        assert isinstance(f, XmlFound)
        return f.args[start:]

    def _step(self) -> bool:
        """Reads what can be decided at the current place; False when more text is needed."""
        state = self._state
        if state == "top":
            return self._tag_or_wait((FUNCTION,))
        if state == "params":
            return self._tag_or_wait((PARAMETER, FUNCTION_END))
        if state in ("name", "key"):
            return self._name()
        return self._value_step()

    def _tag_or_wait(self, tags: tuple[str, ...]) -> bool:
        """Past whitespace, one of ``tags`` opens (read on), may still open (wait), or the text is broken."""
        text, i = self.text, self._i
        while i < len(text) and text[i].isspace():
            i += 1
        self._i = i
        rest = text[i:i + 16]
        for tag in tags:
            if rest.startswith(tag):
                self._i = i + len(tag)
                if tag == FUNCTION_END:
                    self._close_call(i, self._i)
                else:
                    self._state, self._tag = ("name" if tag == FUNCTION else "key"), self._i
                return True
        if not any(tag.startswith(rest) for tag in tags):
            self.broken = True
        return False

    def _name(self) -> bool:
        """A function's or parameter's name, up to ``>`` on the same line."""
        text = self.text
        k = text.find(">", self._i)
        name = text[self._tag:k if k >= 0 else len(text)]
        if "\n" in name or "<" in name:
            self.broken = True
            return False
        if k < 0:
            self._i = len(text)
            return False
        name, self._i = name.strip(), k + 1
        if not name:
            self.broken = True
            return False
        if self._state == "name":
            self._open_call(name, k + 1)
        else:
            self._open_value(name)
        return True

    def _open_call(self, name: str, at: int) -> None:
        schema = self._schemas.get(name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        self._properties = props if isinstance(props, dict) else {}
        self.found.append(XmlFound(name=name, args_start=at, args="{"))
        self._state = "params"

    def _open_value(self, key: str) -> None:
        f = self.found[-1]
        f.args += (", " if f.params else "") + _dump(key) + ": "
        self._types = value_types(self._properties.get(key))
        self._value, self._opened, self._sent = self._i, False, 0
        self._state = "value"

    def _value_step(self) -> bool:
        """The open value: whole once ``</parameter>`` is written; a string's text goes out before."""
        text = self.text
        k = text.find(PARAMETER_END, self._i)
        if k < 0:
            self._i = max(self._value, len(text) - len(PARAMETER_END) + 1)  # a closing tag may be cut here
            if is_text(self._types):
                self._stream_text(text[:len(text) - partial_suffix(text, PARAMETER_END)])
            return False
        self._end_value(k)
        self._i = k + len(PARAMETER_END)
        return True

    def _end_value(self, k: int) -> None:
        """The open value ends at ``k``: the rest of it goes out."""
        if not self._opened and self.text.startswith("\n", self._value):
            self._value += 1
        value = self.text[self._value:k].removesuffix("\n")
        f = self.found[-1]
        if is_text(self._types):
            f.args += ("" if self._opened else '"') + _dump(value[self._sent:])[1:]
        else:
            f.args += _dump(typed_value(value, self._types))
        f.params += 1
        self._state = "params"

    def _stream_text(self, upto: str) -> None:
        """Sends the open string value's text up to where it may end (a last line break may be the template's)."""
        if not self._opened:
            if len(upto) <= self._value:
                return  # its first character tells whether a line break is to be dropped
            self._value += upto[self._value] == "\n"
            self._opened = True
            self.found[-1].args += '"'
        piece = upto[self._value + self._sent:]
        piece = piece.removesuffix("\n")
        if piece:
            self.found[-1].args += _dump(piece)[1:-1]
            self._sent += len(piece)

    def _close_call(self, at: int, end: int) -> None:
        f = self.found[-1]
        f.args += "}"
        f.args_end, f.done, f.end = at, True, end
        self._state = "top"


def read_qwen_xml(body: str, names: set[str] | None, schemas: dict[str, Any] | None = None) -> list[ToolCall] | None:
    """The calls in a section's XML, their values typed by ``schemas`` (function name -> parameters
    schema); None when it is not the format or calls a function not offered."""
    scanner = XmlScanner(schemas)
    scanner.feed(body)
    if not scanner.finish() or not scanner.found:
        return None
    if names is not None and any(f.name not in names for f in scanner.found):
        return None
    return [ToolCall(f.name or "", f.args) for f in scanner.found]


class FunctionsEnd:
    """Where the run of ``<function=...>...</function>`` blocks opening a growing text ends (a call
    written without ``<tool_call>``); None while it may go on. Read on from where the last look stopped."""

    def __init__(self) -> None:
        self._from = 0

    def scan(self, text: str) -> int | None:
        while True:
            i = text.find(FUNCTION_END, self._from)
            if i < 0:
                self._from = max(self._from, len(text) - len(FUNCTION_END) + 1)
                return None
            end = i + len(FUNCTION_END)
            rest = text[end:end + 64].lstrip()
            if rest.startswith(FUNCTION):
                self._from = end  # another call follows
                continue
            self._from = i  # looked at again as more text comes
            return None if FUNCTION.startswith(rest) else end


QWEN3_XML = register(ToolParser("qwen3_xml", "<tool_call>", "</tool_call>", read_qwen_xml,
                                template_marks=(FUNCTION,), scanner=XmlScanner,
                                bare_lead=("<", FUNCTION[1:]), bare_end=FunctionsEnd))
PARSERS["qwen3_coder"] = QWEN3_XML  # vLLM's name for it
