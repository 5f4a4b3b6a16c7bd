"""A chat-template render worker, ``python -m ferry.server.template_worker NICE MEMORY_BYTES``.

A chat template is code: a loop, or one huge string, runs until it is done and no thread can be
halted from outside. ``ferry serve`` renders in processes like this one (``templates.py``),
which it can cancel (SIGUSR1: the render in progress raises and the worker goes on) or kill.
Its memory is bounded (``MEMORY_BYTES`` beyond its idle footprint) and its CPU priority lowered
by ``NICE``.

Frames on stdin (requests) and stdout (replies): 4 bytes of big-endian length, then the body.
A request is JSON: {"template", "conversation", "tools", "add_generation_prompt", "kwargs",
"max_chars"}. A reply is one line of JSON, then for a render the rendered text in UTF-8:
{"ok": true} or {"error": KIND, "message": ...}, KIND one of "template" (the template raised or
failed), "value" (the inputs were refused), "too_long" (more than max_chars), "memory" or
"cancelled". A worker that ran out of memory says so and exits (``"exit": true``).
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
from typing import Any, BinaryIO, Callable


class Cancelled(BaseException):
    """Raised in a render by SIGUSR1; a BaseException, so that no ``except Exception`` in jinja
    or transformers takes it for the template's own error."""


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's body, or None at the end of the stream (the server has gone)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    body = stream.read(int.from_bytes(head, "big"))
    return body if len(body) == int.from_bytes(head, "big") else None


def write_frame(stream: BinaryIO, header: dict[str, Any], text: str = "") -> None:
    body = json.dumps(header).encode() + b"\n" + text.encode("utf-8", "replace")
    stream.write(len(body).to_bytes(4, "big") + body)
    stream.flush()


def renderer() -> Callable[..., str]:
    """transformers' own render (the one its tokenizer's apply_chat_template runs), imported once."""
    from transformers.utils.chat_template_utils import render_jinja_template  # transformers >= 4.48

    def render(template: str, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        out = render_jinja_template(conversations=[conversation], tools=tools, chat_template=template,
                                    add_generation_prompt=add_generation_prompt, **kwargs)
        return (out[0] if isinstance(out, tuple) else out)[0]

    return render


def limit_memory(extra: int) -> None:
    """Data (the heap and anonymous maps) capped at what the worker holds now plus ``extra``: a
    template that builds a huge string gets a MemoryError, not the machine's memory."""
    with open("/proc/self/status") as f:
        data = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:")), 0)
    if data:
        resource.setrlimit(resource.RLIMIT_DATA, (data + extra, data + extra))


def main() -> None:
    nice, memory = int(sys.argv[1]), int(sys.argv[2])
    # Replies go to a copy of stdout; stdout itself becomes stderr, so that nothing a library
    # prints can break a frame.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    if nice:
        os.nice(nice)
    render = renderer()
    limit_memory(memory)
    rendering = False

    def cancel(signum: int, frame: Any) -> None:
        if rendering:  # between renders a late cancel has nothing to end
            raise Cancelled

    signal.signal(signal.SIGUSR1, cancel)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's own Ctrl-C ends it, then this (at EOF)
    write_frame(out, {"ok": True})
    while (frame := read_frame(requests)) is not None:
        text, exit_after = "", False
        try:
            req = json.loads(frame)
            rendering = True
            text = render(req["template"], req["conversation"], req["tools"], req["add_generation_prompt"],
                          req["kwargs"])
            rendering = False
            if len(text) > req["max_chars"]:
                header: dict[str, Any] = {"error": "too_long", "message": str(len(text))}
                text = ""
            else:
                header = {"ok": True}
        except Cancelled:
            rendering = False
            header = {"error": "cancelled", "message": "cancelled"}
        except MemoryError:
            rendering, text, exit_after = False, "", True
            header = {"error": "memory", "message": "out of memory", "exit": True}
        except ValueError as e:
            rendering, text = False, ""
            header = {"error": "value", "message": str(e)[:2000]}
        except Exception as e:  # a template's raise_exception, a jinja error, a type error in it
            rendering, text = False, ""
            header = {"error": "template", "message": f"{type(e).__name__}: {e}"[:2000]}
        write_frame(out, header, text)
        if exit_after:
            break


if __name__ == "__main__":
    main()
