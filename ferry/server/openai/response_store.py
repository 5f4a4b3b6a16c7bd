"""Stored responses for ``previous_response_id`` and ``GET|DELETE /v1/responses/{id}``: in memory,
bounded in count and in bytes, the least recently used dropped first (a server restart forgets
them all, as a client of a stateless server expects).

Each response is held as compact JSON bytes, parsed back when it is read: parsed objects take
many times their JSON's size (a dict or a short string costs 50 to 200 bytes), so holding them
would let the store outgrow its bound; bytes are counted as exactly what they hold."""
from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20
# What one entry costs besides its bytes objects and key: the record and the ordered dict's slot.
ENTRY_OVERHEAD = 128


def _pack(value: Any) -> bytes:
    """Compact JSON, UTF-8 (a lone surrogate, which only unrendered fields could hold, passes through)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _unpack(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class StoredResponse:
    """One kept response: ``body`` is the response object as it was returned, ``items`` the
    conversation so far as input items (each new one parsed from the bytes held)."""

    body_json: bytes
    items_json: bytes
    nbytes: int

    @property
    def body(self) -> dict[str, Any]:
        return _unpack(self.body_json)

    @property
    def items(self) -> list[dict[str, Any]]:
        return _unpack(self.items_json)


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The memory the kept responses take, as counted against ``max_bytes``."""
        return self._bytes

    def put(self, response_id: str, body: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep a response; one larger than the whole bound is not kept."""
        body_json, items_json = _pack(body), _pack(items)
        nbytes = sys.getsizeof(body_json) + sys.getsizeof(items_json) + sys.getsizeof(response_id) + ENTRY_OVERHEAD
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[response_id] = StoredResponse(body_json, items_json, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1].nbytes

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._entries.get(response_id)
            if found is not None:
                self._entries.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            found = self._entries.pop(response_id, None)
            if found is not None:
                self._bytes -= found.nbytes
            return found is not None

    def __len__(self) -> int:
        return len(self._entries)
