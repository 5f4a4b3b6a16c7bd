"""Stored responses for ``previous_response_id`` and ``GET|DELETE /v1/responses/{id}``: in memory,
bounded in count and in bytes, the least recently used dropped first (a server restart forgets
them all, as a client of a stateless server expects)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    items: list[dict[str, Any]]  # the conversation so far as input items: every input, then the output
    nbytes: int


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, body: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep a response; one larger than the whole bound is not kept."""
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries[response_id] = StoredResponse(body, items, nbytes)
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
