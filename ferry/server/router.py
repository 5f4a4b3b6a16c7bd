"""Which replica serves a request: round-robin, least-loaded or prefix-aware.

Pure Python and synchronous: the data-parallel server front (``ferry.server.replicas``) and the
simulator's replicas (``ferry.sim.replicas``) route with this same code.

The router keeps its own view of each replica, updated as it routes, so a burst of arrivals
spreads at once instead of piling onto whichever replica looked idle in its last report:
- load: the requests it sent there that have not finished (what that replica has waiting +
  running), plus the replica's last reported KV usage as the tie-break;
- for prefix-aware routing, the hash chains of the prompts it sent there (the blocks that
  replica's prefix cache most likely holds), bounded like that cache, least recently used out.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from ferry.core.kv_cache_manager import hash_block

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class NoReplicaAlive(RuntimeError):
    """Every replica has died: nothing can serve a request."""


@dataclass
class RouterConfig:
    """``policy``: one of POLICIES. Prefix-aware routing sends a request to the replica holding the
    longest cached prefix of its prompt (at least ``min_prefix_blocks`` full blocks) unless that
    replica is overloaded: more than ``balance_abs + balance_rel x`` the least load; then, and
    when no replica holds a prefix, it routes as least-loaded."""

    policy: str = "least_loaded"
    block_size: int = 16
    cached_blocks_per_replica: int = 65536  # how many block hashes the router remembers per replica
    min_prefix_blocks: int = 1
    balance_abs: int = 16
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        # One message per field, naming it; a bool is not a count, and NaN passes every "<" check.
        for name, lo in (("block_size", 1), ("cached_blocks_per_replica", 1), ("min_prefix_blocks", 1),
                         ("balance_abs", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"router {name} must be an integer >= {lo}, got {v!r}")
        v = self.balance_rel
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
            raise ValueError(f"router balance_rel must be a finite number >= 1, got {v!r}")


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    alive: bool = True
    num_requests: int = 0  # routed there, not finished
    kv_usage: float = 0.0  # last reported, 0-1
    num_routed: int = 0
    num_prefix_hits: int = 0  # requests routed there for a cached prefix
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def load(self) -> tuple[int, float]:
        return self.num_requests, self.kv_usage


class Router:
    """``route(token_ids)`` picks a live replica and counts the request there; ``finished`` takes
    it off when it ends; ``report`` takes a replica's KV usage; ``mark_dead`` stops its traffic."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {num_replicas}")
        self.config = config or RouterConfig()
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self._next = itertools.cycle(range(num_replicas))

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def route(self, token_ids: list[int], exclude: frozenset[int] = frozenset()) -> int:
        """The replica for a prompt (never one in ``exclude``: a retry goes elsewhere)."""
        alive = [i for i in self.alive() if i not in exclude]
        if not alive:
            raise NoReplicaAlive("no replica is alive to serve the request" if not exclude
                                 else "no other replica is alive to retry the request on")
        policy = self.config.policy
        if policy == "round_robin":
            choice = next(i for i in self._next if i in alive)
        else:
            choice = min(alive, key=lambda i: (self.replicas[i].load, i))
        hashes = self._hashes(token_ids) if policy == "prefix_aware" else []
        if hashes:
            best, matched = self._longest_prefix(alive, hashes)
            least = self.replicas[choice].num_requests
            if matched >= self.config.min_prefix_blocks and not self._overloaded(best, least):
                choice = best
                self.replicas[choice].num_prefix_hits += 1
            self._remember(choice, hashes)
        view = self.replicas[choice]
        view.num_requests += 1
        view.num_routed += 1
        return choice

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` ended (finished, aborted or failed)."""
        view = self.replicas[replica]
        view.num_requests = max(0, view.num_requests - 1)

    def report(self, replica: int, kv_usage: float) -> None:
        self.replicas[replica].kv_usage = kv_usage

    def mark_dead(self, replica: int) -> None:
        view = self.replicas[replica]
        view.alive = False
        view.blocks.clear()

    # ------------------------------------------------------------------ prefix-aware
    def _hashes(self, token_ids: list[int]) -> list[bytes]:
        """The prompt's full blocks as the replicas' prefix caches name them (one formula:
        ``hash_block``, the same chain the KV cache manager computes)."""
        bs, hashes = self.config.block_size, []
        for i in range(len(token_ids) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else b"", token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _longest_prefix(self, alive: list[int], hashes: list[bytes]) -> tuple[int, int]:
        """The replica holding the most leading blocks of ``hashes`` (the least loaded on a tie)."""
        best, best_key = alive[0], None
        for i in alive:
            blocks, n = self.replicas[i].blocks, 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            key = (-n, self.replicas[i].load, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        assert best_key is not None
        return best, -best_key[0]

    def _overloaded(self, replica: int, least: int) -> bool:
        c = self.config
        return self.replicas[replica].num_requests > c.balance_abs + c.balance_rel * least

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        blocks = self.replicas[replica].blocks
        # Tail first, so the chain's root is the most recent: evicting a root would make the rest
        # of its chain unreachable (matching stops at the first miss), and a replica's KV cache
        # too evicts a prefix's tail before its head.
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.config.cached_blocks_per_replica:
            blocks.popitem(last=False)


def add_router_args(p) -> None:  # argparse.ArgumentParser
    """``--data-parallel-size`` and ``--router-policy``: ``ferry serve`` and ``ferry simulate``."""
    g = p.add_argument_group("data parallelism")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=1, dest="data_parallel_size",
                   help="engine replicas behind one endpoint (serve: Ray actors; simulate: simulated replicas)")
    g.add_argument("--router-policy", default="least_loaded", choices=POLICIES,
                   help="how a request picks its replica (default: least_loaded)")
