"""Pure-Python heart of ferry: requests, KV blocks, queues and schedulers (no torch here)."""
