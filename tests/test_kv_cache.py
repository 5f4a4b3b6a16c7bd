from ferry.core.block_pool import BlockPool
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.core.sampling_params import SamplingParams


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(), arrival_time=0.0)


def test_pool_take_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.take(3) is not None
    assert pool.take(2) is None
    assert pool.num_free == 1


def test_allocate_slots_takes_only_needed_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", 10)
    assert len(kv.allocate_slots(r, 5)) == 2  # tokens 0..4 -> 2 blocks
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) == []  # tokens 5..7 fit block 1
    r.num_computed_tokens = 8
    assert len(kv.allocate_slots(r, 1)) == 1
    assert kv.pool.num_used == 3


def test_allocate_slots_returns_none_and_takes_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = req("a", 8), req("b", 8)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.pool.num_free == 1 and "b" not in kv.block_tables


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a = req("a", 20)
    kv.allocate_slots(a, 20)
    assert kv.pool.num_free == 0
    kv.free(a)
    assert kv.pool.num_free == 5 and not kv.block_tables


def test_freed_blocks_are_reused_first_so_untouched_memory_stays_untouched():
    """The cache's pages become resident only when written: a server that reuses the blocks it
    freed last touches no more blocks than it ever held at once."""
    pool = BlockPool(100)
    touched: set[int] = set()
    for _ in range(50):  # a request of 10 blocks comes and goes, over and over
        blocks = pool.take(10)
        touched.update(blocks)
        pool.give_back(blocks)
    assert len(touched) == 10
    a, b = pool.take(3), pool.take(2)
    assert len(set(a) | set(b)) == 5 and set(a) | set(b) <= touched
