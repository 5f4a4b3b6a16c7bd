"""Waiting queues: FCFS and priority. Preempted requests go back to the front."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from ferry.core.request import Request


class FCFSQueue:
    """First come, first served; a preempted request is put back at the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def priority_key(req: Request, aging_rate: float = 0.0) -> tuple[float, float, int]:
    """How urgent ``req`` is under the priority policy: smaller is more urgent.

    Lowest ``priority`` value first, then earliest arrival (vLLM's convention). With aging, the
    effective priority at time t is ``priority - aging_rate * (t - arrival)``; every request ages
    at the same rate, so ordering by ``priority + aging_rate * arrival`` is the same at every t,
    and the key never has to change while a request waits.
    """
    return (req.priority + aging_rate * req.arrival_time, req.arrival_time, req.seq)


class PriorityQueue:
    """The most urgent request first (``priority_key``).

    A preempted request keeps its key, which already puts it ahead of everything of its
    priority that arrived later.
    """

    def __init__(self, aging_rate: float = 0.0) -> None:
        self.aging_rate = aging_rate
        self._heap: list[tuple[tuple[float, float, int], Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (priority_key(req, self.aging_rate), req))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[1] for e in sorted(self._heap, key=lambda e: e[0]))


def make_queue(policy: str, aging_rate: float = 0.0) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_rate)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
