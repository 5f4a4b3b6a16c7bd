"""The scheduler's images as properties, with a fake executor that keeps each image's encoding
progress as the model executor does (by hash, up to the share each step names): a step's encoder
work stays within its budget, every chunk reads only images whose encoding is done and held,
shared images are encoded once while held, and everything is let go once nothing reads it."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.core.multimodal import ImageFeature
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from tests.fakes import FakeExecutor
from tests.test_scheduler import make_engine, run_all

# A few images by content (hash, tokens): the same image is the same length in every prompt.
IMAGES = [(bytes([k]) * 4, n) for k, n in enumerate((1, 3, 7, 12, 20))]


class FakeImageExecutor(FakeExecutor):
    """``FakeExecutor`` plus the encoder's bookkeeping, checked (the engine turns a step's error
    into its requests' failure: the problems are also kept, for the test to see)."""

    def __init__(self, budget: int, **kw) -> None:
        super().__init__(**kw)
        self.budget = budget
        self.progress: dict[bytes, int] = {}  # tokens' worth encoded, by hash (held while present)
        self.encoded: dict[bytes, int] = {}  # times each image's encoding was finished
        self.problems: list[str] = []

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)
            raise AssertionError(problem)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for h in out.freed_encoder_hashes:
            self.progress.pop(h, None)
        work = 0
        for _, im, upto in out.encoder_inputs:
            before = self.progress.get(im.hash, 0)
            self.check(0 < upto <= im.length, f"encode {im.hash!r} up to {upto} of {im.length}")
            work += max(0, upto - before)
            self.progress[im.hash] = max(before, upto)
            if before < im.length == upto:
                self.encoded[im.hash] = self.encoded.get(im.hash, 0) + 1
        self.check(work <= self.budget, f"a step ran {work} tokens' worth of encoding, over its budget {self.budget}")
        self.states.apply(out)
        for c in out.chunks:
            for im in self.states[c.request_id].images:
                if im.overlaps(c.start, c.start + c.num_tokens):
                    self.check(self.progress.get(im.hash) == im.length,
                               f"{c.request_id}'s chunk reads an image whose encoding is not done or not held")
        return super().execute(out)


@st.composite
def workloads(draw):
    requests = []
    for k in range(draw(st.integers(1, 6))):
        ids, images = [], []
        for _ in range(draw(st.integers(0, 2))):
            ids += draw(st.lists(st.integers(1, 50), min_size=0, max_size=6))
            h, n = draw(st.sampled_from(IMAGES))
            images.append(ImageFeature(h, len(ids), n))
            ids += [999] * n
        ids += draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
        requests.append((f"r{k}", ids, tuple(images), draw(st.integers(1, 4)), draw(st.integers(0, 3))))
    return requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(2, 24), st.integers(1, 24), st.sampled_from([16, 24, 64]), st.booleans())
def test_images_are_encoded_within_the_budget_before_any_chunk_reads_them(requests, budget, encoder_budget,
                                                                          num_blocks, prefix_caching):
    engine, _ = make_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                            max_num_encoder_tokens=encoder_budget, enable_prefix_caching=prefix_caching,
                            max_model_len=80)
    ex = engine.executor = FakeImageExecutor(encoder_budget, block_size=4)
    waiting = sorted(requests, key=lambda r: r[4])
    step = 0
    final = {}
    while waiting or engine.has_unfinished():
        while waiting and waiting[0][4] <= step:
            rid, ids, images, max_tokens, _ = waiting.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid,
                               images=images)
        final.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        assert step < 5000, "requests did not finish"
    assert ex.problems == []
    assert sorted(final) == sorted(r[0] for r in requests)
    assert all(o.outputs[0].finish_reason == "length" for o in final.values())
    # Nothing is held once the last references end (with the next step's bookkeeping).
    engine.step()
    assert engine.scheduler.encoder_refs == {} and engine.scheduler.encoded == {}
    if engine.num_preemptions == 0 and not prefix_caching:
        # Requests that share an image while it is held encode it once.
        for h, n in ex.encoded.items():
            readers = [r for r in requests if any(im.hash == h for im in r[2])]
            assert 1 <= n <= len(readers)


def test_an_image_over_the_budget_runs_in_shares_with_steps_of_encoder_work_alone():
    engine, ex = make_engine(max_num_batched_tokens=16, max_num_encoder_tokens=5, block_size=4)
    engine.executor = ex = FakeImageExecutor(5, block_size=4)
    h, n = IMAGES[4]  # 20 tokens
    engine.add_request([7, 8] + [999] * n + [9], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a",
                       images=(ImageFeature(h, 2, n),))
    run_all(engine)
    assert ex.problems == []
    assert [[u for _, _, u in s.encoder_inputs] for s in ex.steps[:4]] == [[5], [10], [15], [20]]
    assert [s.num_scheduled_tokens for s in ex.steps[:5]] == [{"a": 2}, {}, {}, {"a": 16}, {"a": 5}]
    assert ex.encoded == {h: 1}
