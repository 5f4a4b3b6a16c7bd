"""Structured outputs: grammar-constrained sampling on xgrammar.

A :class:`GrammarCompiler` is built once per executor. It turns a request's
:class:`~ferry.core.sampling_params.StructuredOutputs` into a compiled grammar (cached by spec)
and hands out a :class:`RequestGrammar` per request, which masks that request's logits row
(tokens the grammar forbids -> -inf) and advances with each token sampled.

xgrammar was chosen over llguidance by measured per-token cost on the embedded model's tokenizer
(vocab 49152, 2-core CPU, medians): mask + apply + advance for a JSON schema ~85-105 us against
~145-205 us (the mask alone ~3.5 us against ~35 us: xgrammar precomputes most of each state's
mask when it compiles), json_object ~85 us against ~95 us. The price is compile time: ~65 ms for
a schema against ~2.5 ms, paid once per distinct spec thanks to the cache.
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ferry.core.sampling_params import StructuredOutputs
from ferry.model.tokenizer import TRANSFORMERS_LOCK

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept. A JSON schema compiles in ~65 ms here: a client that sends the same few
# schemas over and over pays that once; one that sends a new schema each time cannot grow memory.
GRAMMAR_CACHE_SIZE = 32
# A grammar that takes longer to compile is refused (--max-grammar-compile-seconds): a regex such
# as [^x]{0,5000}[0-9]{0,5000} is a few bytes and takes seconds.
DEFAULT_MAX_COMPILE_SECONDS = 10.0
# Specs that went over the bound, remembered so that sending one again is refused at once.
SLOW_SPECS_KEPT = 256
# Compiles running at once, each on a thread of its own: xgrammar cannot interrupt a compile, so a
# request behind slow ones on a shared thread would wait for theirs. Past this, specs queue.
MAX_CONCURRENT_COMPILES = 16
# A compile still running after this long drops to the lowest CPU priority for the rest of its run:
# a JSON schema takes ~1-100 ms and goes ahead of it, and so does the step loop.
DEMOTE_AFTER_SECONDS = 0.25
LOWEST_NICE = 19
_NEG_INF = np.float32(-np.inf)


@dataclass
class DerivedOutputs(StructuredOutputs):
    """A constraint the server derived from other fields of the request (a forced tool call's
    grammar, from ``tools`` and ``tool_choice``): its errors start with ``source``, what the
    client sent, instead of ``structured_outputs``, which it did not."""

    source: str = "structured_outputs"


class _Refused(ValueError):
    """A compile's own error, without the field: each waiter names the field it sent."""


def _field(spec: StructuredOutputs, kind: str) -> str:
    """The request field an error about ``spec`` names."""
    return spec.source if isinstance(spec, DerivedOutputs) else f"structured_outputs.{kind}"


def _demote(tid: int) -> None:
    """Move thread ``tid`` to the lowest CPU priority (Linux keeps a nice value per thread; raising
    it needs no privilege). Elsewhere a nice value is per process: nothing is done there."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
        except OSError:  # a sandbox that forbids it: the compile runs on at its priority
            pass


class _Job:
    """One spec's compile: queued, then running on its own thread (``tid``) from ``started``."""

    __slots__ = ("future", "kind", "text", "tid", "started", "demoted")

    def __init__(self, future: Future, kind: str, text: str) -> None:
        self.future, self.kind, self.text = future, kind, text
        self.tid: int | None = None
        self.started = 0.0
        self.demoted = False


_SUBSCHEMA = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems", "items")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def rebase_refs(schema: Any, at: str) -> Any:
    """A copy of ``schema`` for embedding at the JSON pointer ``at`` of another schema: its local
    references (``#``, ``#/$defs/X``, any ``#/...``) point to the same places inside the copy, so
    they resolve against the schema they were written for, not the one around it. Only schema
    keywords are followed: a ``const``, ``enum`` or ``default`` value is data and left as it is."""
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema at all
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + at + v[1:]
        elif k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: rebase_refs(sub, at) for name, sub in v.items()}
        elif k in _SUBSCHEMA_LISTS and isinstance(v, list):
            out[k] = [rebase_refs(sub, at) for sub in v]
        elif k in _SUBSCHEMA:
            out[k] = rebase_refs(v, at)
        else:
            out[k] = v
    return out


def _clean(e: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line:' prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e)).strip()


def apply_token_bitmask(row: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set the logits of the tokens whose bit is 0 in ``bitmask`` (int32 words, 32 tokens each,
    least significant bit first) to -inf, in place on one contiguous float32 row."""
    allowed = np.unpackbits(bitmask.view(np.uint8), count=row.shape[0], bitorder="little").view(bool)
    # numpy's masked copy is 2-3x faster than torch's masked_fill_ on one CPU row.
    np.copyto(row.numpy(), _NEG_INF, where=~allowed)


class RequestGrammar:
    """One request's place in its grammar.

    It counts the output tokens it has consumed, and :meth:`mask` first brings that count to the
    request's: a step that failed after sampling and is retried has fewer output tokens than were
    consumed (those are rolled back), and a matcher built late replays the tokens it missed.
    """

    def __init__(self, compiled: "xgr.CompiledGrammar", vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)  # unlimited rollback; terminates only on a stop token
        self._bitmask = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        self._accepted = 0  # tokens the xgrammar matcher holds
        self._rejected = 0  # tokens after the first one the grammar refused (the matcher holds none)

    @property
    def num_consumed(self) -> int:
        """Output tokens consumed so far."""
        return self._accepted + self._rejected

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was consumed (or the matcher failed)."""
        return self._rejected > 0 or self._matcher.is_terminated()

    def advance(self, token_id: int) -> None:
        """Consume the token sampled for this request."""
        # A refused token can only come from outside the mask (a rejected token leaves xgrammar's
        # state as it was): count it, and from then on allow only a stop token.
        if self._rejected or not self._matcher.accept_token(token_id):
            self._rejected += 1
        else:
            self._accepted += 1

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Roll back or replay so that exactly ``output_token_ids`` are consumed."""
        drop = self.num_consumed - len(output_token_ids)
        if drop > 0:
            undo = min(drop, self._rejected)
            self._rejected -= undo
            if drop > undo:
                self._matcher.rollback(drop - undo)
                self._accepted -= drop - undo
        for t in output_token_ids[self.num_consumed:]:
            self.advance(t)

    def mask(self, row: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        """Set the logits of every token the grammar forbids after ``output_token_ids`` to -inf,
        in place on one float32 row. Once the grammar is complete only stop tokens remain."""
        self.sync(output_token_ids)
        if self.is_terminated:
            keep = row[self._stop].clone()
            row.fill_(float("-inf"))
            row[self._stop] = keep
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        apply_token_bitmask(row, self._bitmask[0])


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; the one place xgrammar is set up.

    Compiles never run on the step loop nor the server's thread pool: each distinct spec compiles
    on a thread of its own as soon as it arrives (xgrammar releases the GIL), so a request waits
    only for its own grammar. A compile cannot be interrupted, so the rule for slow ones is: one
    thread per distinct spec (requests for a spec compiling already share its compile), at most
    ``MAX_CONCURRENT_COMPILES`` at once (past that, specs queue in order of arrival), and a compile
    still running after ``DEMOTE_AFTER_SECONDS`` drops to the lowest CPU priority, so that quick
    compiles and the step loop go ahead of it and slow ones share the CPU left over. A request
    waits at most ``max_compile_seconds`` for its grammar and is then refused (ValueError naming
    the field), and so is the same spec sent again. Nothing is built until the first spec
    arrives, so an engine that never sees one pays nothing at start-up. Safe to call from any thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE,
                 max_compile_seconds: float = DEFAULT_MAX_COMPILE_SECONDS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.cache_size = cache_size
        self.max_compile_seconds = max_compile_seconds
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._tokenizer_info: "xgr.TokenizerInfo | None" = None
        self._build_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], "xgr.CompiledGrammar"] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}  # compiling now (or queued)
        self._slow: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._launcher: threading.Thread | None = None
        self._closed = False
        # request id -> its compiled grammar, from its check to its end: the step loop never
        # compiles a grammar the cache let go of while the request waited.
        self._held: dict[str, "xgr.CompiledGrammar"] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the launcher's: a job queued, started or done
        self.num_compiles = 0  # compiles started (cache misses that were not already compiling)

    def _build(self) -> "xgr.GrammarCompiler":
        with TRANSFORMERS_LOCK:  # xgrammar imports transformers
            import xgrammar as xgr

        fast = self.tokenizer._fast  # ferry's Tokenizer wraps a `tokenizers.Tokenizer`
        vocab = [""] * self.vocab_size
        for text, i in fast.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                vocab[i] = text
        # xgrammar takes empty strings for special tokens: without this "<|im_start|>" and the
        # like would be legal inside a JSON string, and vanish from the decoded text.
        for i, added in fast.get_added_tokens_decoder().items():
            if added.special and i < self.vocab_size:
                vocab[i] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(fast.to_str())
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                 stop_token_ids=list(self.stop_token_ids),
                                 add_prefix_space=meta["add_prefix_space"])
        self._tokenizer_info = info
        # xgrammar's own cache has no size limit by default: ours (an LRU) replaces it. One thread
        # per compile: concurrent compiles are ours, each on its own thread.
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _built(self) -> "xgr.GrammarCompiler":
        """The xgrammar compiler, built by the first thread that needs it."""
        with self._build_lock:
            if self._compiler is None:
                self._compiler = self._build()
            return self._compiler

    @property
    def ready(self) -> bool:
        """The tokenizer's tables are built: a compile starts at once."""
        return self._compiler is not None

    def prepare(self) -> None:
        """Build the tokenizer's tables now, once (~0.3-3 s), or wait for the thread building them:
        the bound on a wait covers the spec's own compile, not this."""
        self._built()

    def _compile_now(self, kind: str, text: str) -> "xgr.CompiledGrammar":
        """On a compile thread: compile one spec and cache it."""
        c = self._built()
        try:
            if kind in ("json", "json_object"):
                # No free whitespace: a sampled run of spaces or newlines could then never end.
                # The separators are json.dumps' (", " and ": "), the ones models see most.
                compiled = c.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind == "structural_tag":
                compiled = c.compile_structural_tag(text)
            else:  # choice, grammar: EBNF
                compiled = c.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            what = {"json": "invalid JSON schema", "regex": "invalid regular expression",
                    "grammar": "invalid EBNF grammar", "structural_tag": "invalid structural tag"}.get(kind, "cannot compile")
            raise _Refused(f"{what}: {_clean(e)}") from None
        with self._lock:
            self._cache[(kind, text)] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _too_slow(self, spec: StructuredOutputs) -> ValueError:
        return ValueError(f"{_field(spec, _key(spec)[0])}: the grammar did not compile within "
                          f"{self.max_compile_seconds:g} s (--max-grammar-compile-seconds); "
                          f"send a simpler one")

    def refused(self, spec: StructuredOutputs, e: ValueError) -> ValueError:
        """The error for ``spec`` of a compile that failed: it names the field the request sent."""
        return ValueError(f"{_field(spec, _key(spec)[0])}: {e}") if isinstance(e, _Refused) else e

    def compile_future(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar of ``spec``: done at once from the cache, else the
        one compile of that spec (started now, or already under way for another request). Its
        error, if any, is the compile's own: :meth:`refused` names the field.

        Raises ValueError at once for a spec that went over the time bound before."""
        key = _key(spec)
        field = spec.source if isinstance(spec, DerivedOutputs) else "structured_outputs"
        if self.tokenizer is None:
            raise ValueError(f"{field} needs the model's tokenizer, and this model has none")
        if not self.stop_token_ids:
            raise ValueError(f"{field} needs an end-of-sequence token, and this model has none")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(hit)
                return done
            if key in self._slow:
                raise self._too_slow(spec)
            f = self._pending.get(key)
            if f is None:
                f = self._pending[key] = Future()
                self._queue.append(_Job(f, *key))
                if self._launcher is None:
                    # A daemon: a pathological compile under way never holds up the process' exit.
                    self._launcher = threading.Thread(target=self._launch, name="ferry-grammar-launcher",
                                                      daemon=True)
                    self._launcher.start()
                self._wake.notify()
                self.num_compiles += 1
                f.add_done_callback(lambda done, key=key: self._settled(key, done))
        return f

    def _launch(self) -> None:
        """The launcher thread: starts each queued compile on a thread of its own while fewer than
        MAX_CONCURRENT_COMPILES run, and demotes the ones that run long. Compile threads are born
        here, at the server's priority: a thread takes its creator's nice value, and a demoted
        thread may not raise its own back."""
        with self._wake:
            while not self._closed:
                while self._queue and len(self._running) < MAX_CONCURRENT_COMPILES:
                    job = self._queue.popleft()
                    # False: dropped while queued (its waiters ran out of time); no callback runs here.
                    if job.future.set_running_or_notify_cancel():
                        self._running.add(job)
                        threading.Thread(target=self._run, args=(job,), name="ferry-grammar", daemon=True).start()
                self._wake.wait(self._demote_due())

    def _demote_due(self) -> float | None:
        """Under the lock: demote the compiles that have run DEMOTE_AFTER_SECONDS; the seconds
        until the next one is due (None: none is running undemoted)."""
        now, due = time.monotonic(), None
        for job in self._running:
            if job.tid is None or job.demoted:
                continue
            left = job.started + DEMOTE_AFTER_SECONDS - now
            if left <= 0:
                job.demoted = True
                _demote(job.tid)  # still in its compile: it leaves _running (under the lock) first
            else:
                due = left if due is None else min(due, left)
        return due

    def _run(self, job: _Job) -> None:
        """A compile thread: one spec, then the thread ends (a demoted thread is never reused)."""
        try:
            self._built()  # the tokenizer's tables, once: not counted as this spec's compile time
            with self._wake:
                job.tid, job.started = threading.get_native_id(), time.monotonic()
                self._wake.notify()
            result: Any = self._compile_now(job.kind, job.text)
        except BaseException as e:  # handed to the waiters
            result = e
        with self._wake:
            self._running.discard(job)
            self._wake.notify()
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    def _settled(self, key: tuple[str, str], f: Future) -> None:
        with self._lock:
            if self._pending.get(key) is f:
                del self._pending[key]

    def timed_out(self, spec: StructuredOutputs, f: Future) -> ValueError:
        """The error for a wait on ``f`` that ran past the bound. A compile still queued is
        dropped; one that ran past the bound is remembered, so the spec is refused at once next
        time (a running compile cannot be stopped: it finishes on its thread, at the lowest priority)."""
        key = _key(spec)
        if not f.cancel():
            with self._lock:
                self._slow[key] = None
                while len(self._slow) > SLOW_SPECS_KEPT:
                    self._slow.popitem(last=False)
        return self._too_slow(spec)

    def compile(self, spec: StructuredOutputs) -> "xgr.CompiledGrammar":
        """The compiled grammar of ``spec`` (from the cache when it was seen lately), waiting at
        most ``max_compile_seconds``.

        Raises ValueError naming the field when the schema, regex or grammar is invalid or too slow."""
        f = self.compile_future(spec)
        if not f.done():
            self.prepare()
        try:
            return f.result(timeout=self.max_compile_seconds)
        except (FutureTimeout, CancelledError):
            raise self.timed_out(spec, f) from None
        except _Refused as e:
            raise self.refused(spec, e) from None

    def validate(self, spec: StructuredOutputs) -> "xgr.CompiledGrammar":
        """Compile ``spec`` (caching it) and return it, or raise ValueError naming the field."""
        return self.compile(spec)

    def hold(self, request_id: str, compiled: "xgr.CompiledGrammar") -> None:
        """Keep ``request_id``'s compiled grammar until ``release``: its matcher is built from it."""
        with self._lock:
            self._held[request_id] = compiled

    def release(self, request_ids: Sequence[str]) -> None:
        """Let go of the grammars of finished requests."""
        if self._held:
            with self._lock:
                for rid in request_ids:
                    self._held.pop(rid, None)

    def serialized(self, request_id: str) -> str | None:
        """The held grammar of ``request_id`` as text another process can load (``hold_serialized``)."""
        compiled = self._held.get(request_id)
        return None if compiled is None else compiled.serialize_json()

    def hold_serialized(self, request_id: str, text: str) -> None:
        """Hold a grammar compiled in another process for the same tokenizer (a tensor-parallel
        driver's): loading it costs far less than compiling it again on the step loop."""
        self._built()
        import xgrammar as xgr

        self.hold(request_id, xgr.CompiledGrammar.deserialize_json(text, self._tokenizer_info))

    def new_request(self, spec: StructuredOutputs, request_id: str | None = None) -> RequestGrammar:
        """A fresh matcher for one request, at the start of the grammar (the request's held one)."""
        compiled = self._held.get(request_id) if request_id is not None else None
        if compiled is None:
            compiled = self.compile(spec)
        return RequestGrammar(compiled, self.vocab_size, self.stop_token_ids)

    def close(self) -> None:
        """Stop the launcher: no queued compile starts (those under way finish in the background)."""
        with self._wake:
            self._closed = True
            self._wake.notify()


async def await_compiled(grammars: GrammarCompiler, spec: StructuredOutputs) -> None:
    """Wait, without holding a thread, until ``spec`` is compiled (and cached); raise ValueError
    naming the field when it is invalid or takes over the bound. Leaving early (a client's
    disconnect) does not cancel the compile that other requests may share."""
    import asyncio

    f = grammars.compile_future(spec)
    try:
        if f.done() and not f.cancelled():
            f.result()
            return
        if not grammars.ready:  # once per process: not held against this spec's bound
            await asyncio.to_thread(grammars.prepare)
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(f)), grammars.max_compile_seconds)
    except asyncio.TimeoutError:
        raise grammars.timed_out(spec, f) from None
    except asyncio.CancelledError:
        if f.cancelled():  # another waiter's timeout dropped the queued compile
            raise grammars.timed_out(spec, f) from None
        raise
    except ValueError as e:
        raise grammars.refused(spec, e) from None


def _key(spec: StructuredOutputs) -> tuple[str, str]:
    """(field, the text xgrammar compiles): the cache key, so equal specs share one grammar."""
    if spec.json is not None:
        # Not sort_keys: the order of "properties" is the order the grammar writes them in.
        return "json", spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if spec.json_object:
        return "json_object", '{"type": "object"}'
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        # EBNF string literals take JSON's escapes; non-ASCII stays as UTF-8 text.
        return "choice", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    if spec.structural_tag is not None:
        return "structural_tag", spec.structural_tag
    assert spec.grammar is not None
    return "grammar", spec.grammar
