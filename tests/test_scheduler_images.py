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
    for k in range(draw(st.integers(1, 7))):
        ids, images = [], []
        for _ in range(draw(st.integers(0, 3))):
            ids += draw(st.lists(st.integers(1, 50), min_size=0, max_size=6))
            h, n = draw(st.sampled_from(IMAGES))
            images.append(ImageFeature(h, len(ids), n))
            ids += [999] * n
        ids += draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
        requests.append((f"r{k}", ids, tuple(images), draw(st.integers(1, 5)), draw(st.integers(0, 4)),
                         draw(st.integers(0, 3))))
    return requests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(2, 24), st.integers(1, 24), st.sampled_from([24, 32, 64]), st.booleans(),
       st.sampled_from(["fcfs", "priority"]), st.booleans(), st.integers(1, 8), st.booleans(), st.randoms())
def test_images_are_encoded_within_the_budget_before_any_chunk_reads_them(
        requests, budget, encoder_budget, num_blocks, prefix_caching, policy, whole_images, max_num_seqs,
        interrupt, rnd):
    """Under either policy (priority preemption too), prompts that hold their images whole or not,
    aborts and prefix-cache resets between steps."""
    kw = {"scheduling_policy": "priority", "priority_preemption": True} if policy == "priority" else {}
    engine, _ = make_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                            max_num_encoder_tokens=encoder_budget, enable_prefix_caching=prefix_caching,
                            max_model_len=96, max_num_seqs=max_num_seqs, **kw)
    ex = engine.executor = FakeImageExecutor(encoder_budget, block_size=4)
    sched = engine.scheduler
    sched.whole_images = whole_images
    waiting = sorted(requests, key=lambda r: r[4])
    step, final, aborted = 0, {}, set()
    while waiting or engine.has_unfinished():
        while waiting and waiting[0][4] <= step:
            rid, ids, images, max_tokens, _, priority = waiting.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid,
                               images=images, priority=priority)
        if interrupt and sched.requests and rnd.random() < 0.08:
            rid = rnd.choice(sorted(sched.requests))
            engine.abort(rid)
            aborted.add(rid)
        if interrupt and rnd.random() < 0.1:
            engine.reset_prefix_cache()
        final.update({o.request_id: o for o in engine.step() if o.finished})
        # A request holds an image only while it is alive and short of the image's last span (but for
        # the releases the next step makes); no progress outlives its image's references.
        releasing = set(sched._encoder_releases)
        for h, refs in sched.encoder_refs.items():
            for r in refs - {r for g, r in releasing if g == h}:
                req = sched.requests[r]
                assert req.num_computed_tokens < max(im.end for im in req.images if im.hash == h)
        assert set(sched.encoded) <= set(sched.encoder_refs)
        step += 1
        assert step < 3000, "requests did not finish"
    assert ex.problems == []
    assert set(final) | aborted == {r[0] for r in requests}
    assert all(o.outputs[0].finish_reason in ("length", "abort") for o in final.values())
    # Nothing is held once the last references end (with the next step's bookkeeping).
    engine.step()
    assert sched.encoder_refs == {} and sched.encoded == {}
    if engine.num_preemptions == 0 and not prefix_caching and not interrupt:
        # Requests that share an image while it is held encode it once.
        for h, n in ex.encoded.items():
            readers = [r for r in requests if any(im.hash == h for im in r[2])]
            assert 1 <= n <= len(readers)


def test_a_chunk_planned_on_encoder_work_that_a_preemption_drops_still_gets_its_image():
    """P (urgent) plans a chunk over an image whose encoding Y's work in the step finishes; P's
    blocks then preempt Y, dropping Y's work: the image is still finished for P's chunk."""
    engine, _ = make_engine(num_blocks=5, block_size=4, max_num_batched_tokens=16, max_num_encoder_tokens=4,
                            long_prefill_token_threshold=8, scheduling_policy="priority", max_model_len=80)
    ex = engine.executor = FakeImageExecutor(4, block_size=4)
    h = IMAGES[3][0]  # 12 tokens
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request([1, 2, 3, 4] + [999] * 12 + [5], sp, request_id="Y", priority=5, images=(ImageFeature(h, 4, 12),))
    engine.step()
    engine.add_request([1, 1, 1, 1] + [999] * 12 + [2], sp, request_id="P", priority=0, images=(ImageFeature(h, 4, 12),))
    for _ in range(4):
        engine.step()
    assert any(s.preempted_req_ids == ["Y"] for s in ex.steps)
    assert ex.problems == []


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
