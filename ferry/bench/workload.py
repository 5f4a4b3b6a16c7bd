"""Benchmark workloads: JSON files of requests with prompt_token_ids and max_tokens."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read a workload file (``{"requests": [...]}`` or a bare list)."""
    data = json.loads(Path(path).read_text())
    items = data["requests"] if isinstance(data, dict) else data
    out = []
    for i, r in enumerate(items):
        if "prompt_token_ids" not in r or "max_tokens" not in r:
            raise ValueError(f"{path}: request {i} needs prompt_token_ids and max_tokens")
        out.append(WorkloadRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]),
                                   float(r.get("arrival_time", 0.0)), int(r.get("priority", 0))))
    return out
