"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration: a tiny random model made by
transformers (float32, eager; a 3-block vision tower with two deepstack mergers) with its image
processor config saved beside it, and 32..64-pixel images. Prompt logprobs, greedy tokens and
their logprobs through ferry.LLM with one and two images, chunks that cut an image's span, the
encoder budget, preemption, and prefix-cache keys that hold the image's hash. The same vision
tower (no deepstack) before Qwen3.5's hybrid language model."""
from __future__ import annotations

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.model.kernels import load_kernels
from ferry.multimodal.processor import ImagePrompter
from tests.vl_models import (NEW, check, hf_greedy, hf_logprobs, image, make_qwen3_5_vl_model, make_vl_model, record,
                             run)

P = "<|vision_start|><|image_pad|><|vision_end|>"
TOL = 1e-4


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    model = make_vl_model(path)
    prompter = ImagePrompter.for_model(path)
    prompts = [prompter.encode(f"w5 w7 {P} w9 w11 w13 w2", [image(64, 64, 1)]),  # one image of 16 tokens
               prompter.encode(f"w5 w8 {P} w9 w11 {P} w3 w4", [image(32, 32, 2), image(48, 64, 3)]),  # 4 and 12
               prompter.encode("w5 w7 w9 w11 w13 w2 w17", [])]  # text alone
    refs = [(hf_logprobs(model, ids, ims), *hf_greedy(model, ids, ims, NEW)) for ids, ims in prompts]
    return path, model, prompter, prompts, refs


def engine(path, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "block_size": 4, "num_kv_blocks": 64,
          "enable_prefix_caching": True, **kw}
    return LLM(model=str(path), quant_activations="exact", **kw)





def test_the_prompter_expands_each_placeholder_to_its_image_tokens(vl):
    path, model, prompter, prompts, refs = vl
    ids, images = prompts[1]
    assert [(im.offset, im.length) for im in images] == [(3, 4), (11, 12)]
    assert ids[2] == 300 and ids[3:7] == [301] * 4 and ids[7] == 303 and ids[11:23] == [301] * 12
    again = prompter.encode(f"w1 {P}", [image(32, 32, 2)])[1][0]
    assert again.hash == images[0].hash and again.hash != prompts[0][1][0].hash
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        prompter.encode(f"w1 {P}", [image(32, 32, 2), image(32, 32, 3)])


def test_logprobs_and_greedy_tokens_match_transformers_with_chunks_cutting_images(vl):
    path, model, prompter, prompts, refs = vl
    llm = engine(path)
    if load_kernels() is not None:
        assert llm.engine.executor.model.fused is not None  # decode (positions shifted) stays fused
    steps = record(llm)
    diff = check(run(llm, prompts), prompts, refs)
    print(f"qwen3-vl max |d logprob| {diff:.2e}")
    assert diff < TOL
    # Some chunk ended inside an image's span, and the image was encoded once for all its chunks.
    spans = {(p[0][:3] == prompts[0][0][:3], im.offset, im.end) for p in prompts[:2] for im in p[1]}
    ends = [c.start + c.num_tokens for s in steps for c in s.chunks]
    assert any(off < e < end for _, off, end in spans for e in ends)
    assert llm.engine.executor.images.encoder.num_encoded == 3
    # Once nothing reads them, the encoder outputs go.
    check(run(llm, prompts, [2]), prompts, refs, [2])
    assert llm.engine.executor.images.cache == {} and llm.engine.scheduler.encoder_refs == {}


def test_a_reset_prefix_cache_starts_the_encoder_cold_too(vl):
    """A one-token request's image output stays until a next step; a reset of the prefix cache in
    between forgets it, so the same image is encoded again (benchmarks' repeated runs, each reset,
    measure the encoder each time)."""
    path, model, prompter, prompts, refs = vl
    llm = engine(path, max_num_encoder_tokens=16)  # the image encoded in the first step
    enc, held = llm.engine.executor.images.encoder, llm.engine.executor.images.cache
    ids, images = prompts[0]

    def first_token() -> int:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, images=[images])
        return out[0].outputs[0].token_ids[0]

    assert first_token() == refs[0][1][0] and enc.num_encoded == 1 and held  # held until a next step
    llm.engine.reset_prefix_cache()
    steps = record(llm)
    assert first_token() == refs[0][1][0] and enc.num_encoded == 2
    assert steps[0].freed_encoder_hashes == [images[0].hash] and steps[0].encoder_inputs


def test_bookkeeping_of_a_step_that_runs_nothing_reaches_the_executor(vl):
    """A step with no chunks is skipped by the engine; the encoder outputs it freed and the requests
    that finished before it reach the executor with the next step that runs (else each idle moment
    would keep an image's output and a request's state for good)."""
    path, model, prompter, prompts, refs = vl
    llm = engine(path, max_num_encoder_tokens=16)  # the image encoded in the first step
    ex = llm.engine.executor
    ids, images = prompts[0]
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, images=[images])
    assert ex.images.cache and ex.states.requests  # the finished request's state and image output
    assert llm.engine.step() == []  # nothing to run: the scheduler frees the output, the step is skipped
    assert ex.images.cache
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert ex.images.cache == {} and len(ex.states.requests) == 1  # only the text request just run



def test_the_encoder_budget_ends_a_chunk_before_an_image_that_does_not_fit(vl):
    path, model, prompter, prompts, refs = vl
    llm = engine(path, max_num_batched_tokens=64, max_num_encoder_tokens=16)
    steps = record(llm)
    assert check(run(llm, prompts, [0, 1]), prompts, refs, [0, 1]) < TOL
    first = {c.request_id: c for c in steps[0].chunks}
    a, b = (c.request_id for c in steps[0].chunks)  # boarded in order
    # The first prompt's 16-token image takes the whole budget: the second stops before its first image.
    assert first[a].num_tokens == len(prompts[0][0]) and first[b].num_tokens == prompts[1][1][0].offset
    assert steps[0].encoder_inputs == [(a, prompts[0][1][0], 16)]
    assert steps[1].encoder_inputs == [(b, prompts[1][1][0], 4), (b, prompts[1][1][1], 12)]  # 4 + 12 tokens fit


def test_an_image_larger_than_the_encoder_budget_is_encoded_over_several_steps(vl):
    """Each step runs the budget's share of the image's encoding (steps of encoder work alone while
    the prompt waits at the image), and the tokens are still transformers'."""
    path, model, prompter, prompts, refs = vl
    llm = engine(path, max_num_batched_tokens=64, max_num_encoder_tokens=5)
    jobs = llm.engine.executor.images.jobs
    shares = []
    llm.engine.executor.images.encoder.vision.piece_rows = 16  # a 64x64 image's 64 patches in 4 pieces a block
    steps = record(llm)
    step = llm.engine.step

    def spy(*a, **kw):
        got = step(*a, **kw)
        shares.append([round(j.share, 3) for j in jobs.values()])
        return got

    llm.engine.step = spy
    assert check(run(llm, prompts, [0]), prompts, refs, [0]) < TOL
    im = prompts[0][1][0]
    assert [s.encoder_inputs[0][2] for s in steps[:4]] == [5, 10, 15, 16]
    assert [[(c.start, c.num_tokens) for c in s.chunks] for s in steps[:4]] == [[(0, 3)], [], [], [(3, len(prompts[0][0]) - 3)]]
    assert all(s.encoder_inputs[0][1] == im for s in steps[:4]) and not any(s.encoder_inputs for s in steps[4:])
    # The tower (3 blocks: projections and 4 row pieces each; 2 deepstack mergers; the embedding and
    # the merger: 19 pieces) ran at least the share scheduled, and no more than a piece past it.
    for got, upto in zip(shares[:3], (5, 10, 15)):
        assert len(got) == 1 and upto / 16 <= got[0] < upto / 16 + 1 / 19 + 1e-9
    assert shares[3] == [] and llm.engine.executor.images.encoder.num_encoded == 1


def test_an_image_that_fails_to_encode_fails_its_request_alone(vl):
    """The tower raising halfway through an image encoded over several steps (in a step where its
    request runs encoder work alone) fails that image's request; the others' tokens are transformers'."""
    path, model, prompter, prompts, refs = vl
    llm = engine(path, max_num_batched_tokens=64, max_num_encoder_tokens=5)
    images = llm.engine.executor.images
    bad, pieces, tries = prompts[0][1][0].hash, images.encoder.pieces, []

    def failing(image):
        if image.hash != bad:
            return (yield from pieces(image))
        for share in (0.1, 0.2, 0.3, 0.4, 0.5):  # the first step runs 5 of 16 tokens' worth, to 0.4
            yield share
        tries.append(llm.engine.scheduler.num_steps)
        raise RuntimeError("the tower broke")

    images.encoder.pieces = failing
    outs = run(llm, prompts)
    assert outs[0].outputs[0].finish_reason == "error" and "the tower broke" in str(outs[0].outputs[0].stop_reason)
    assert set(tries) == {2}  # failed in the second step (the engine's retries aside; later steps would try again)
    assert check(outs[1:], prompts, refs, [1, 2]) < TOL
    llm.engine.step()  # the last references end
    assert images.jobs == {} and images.cache == {} and llm.engine.scheduler.encoder_refs == {}


def test_preempted_requests_recompute_their_images(vl):
    path, model, prompter, prompts, refs = vl
    llm = engine(path, num_kv_blocks=12)
    assert check(run(llm, prompts), prompts, refs) < TOL
    assert llm.engine.num_preemptions > 0


def test_prefix_cache_blocks_hold_the_image_hash(vl):
    path, model, prompter, prompts, refs = vl
    llm = engine(path)
    kv = llm.engine.scheduler.kv
    # The same text with another image shares no block (the first block holds the image's start).
    other = prompter.encode(f"w5 w7 {P} w9 w11 w13 w2", [image(64, 64, 9)])
    assert other[0] == prompts[0][0]
    other_refs = (hf_logprobs(model, *other), *hf_greedy(model, *other, NEW))
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    llm.generate([prompts[0][0]], sp, use_tqdm=False, images=[prompts[0][1]])
    hits = kv.num_hit_tokens
    out = llm.generate([other[0]], sp, use_tqdm=False, images=[other[1]])
    assert kv.num_hit_tokens == hits
    assert out[0].outputs[0].token_ids == other_refs[1]
    # The same image again: its blocks are found, and the tokens are still transformers'.
    out = llm.generate([prompts[0][0]], sp, use_tqdm=False, images=[prompts[0][1]])
    assert kv.num_hit_tokens > hits
    assert out[0].outputs[0].token_ids == refs[0][1]
    got = torch.tensor([out[0].outputs[0].logprobs[j][t] for j, t in enumerate(refs[0][1])])
    assert float((got - refs[0][2]).abs().max()) < TOL


def test_qwen3_5_with_its_vision_tower_matches_transformers(tmp_path):
    model = make_qwen3_5_vl_model(tmp_path)
    prompter = ImagePrompter.for_model(tmp_path)
    prompts = [prompter.encode(f"w5 w7 {P} w9 w11 w13 w2", [image(64, 64, 1)]),
               prompter.encode(f"w5 w8 {P} w9 w11 {P} w3 w4", [image(32, 32, 2), image(48, 64, 3)])]
    refs = [(hf_logprobs(model, ids, ims), *hf_greedy(model, ids, ims, NEW)) for ids, ims in prompts]
    llm = engine(tmp_path, num_kv_blocks=12)  # chunks of 8 cut the images; few blocks preempt
    diff = check(run(llm, prompts), prompts, refs)
    print(f"qwen3.5 with images max |d logprob| {diff:.2e}")
    assert diff < TOL
    assert llm.engine.num_preemptions > 0
    # An image that will not encode fails its request alone (recurrent states make a retry of the
    # step unsafe, so encoder work runs, and fails, before anything else of the step moves).
    llm = engine(tmp_path, max_num_encoder_tokens=5)
    images = llm.engine.executor.images
    bad, pieces = prompts[1][1][1].hash, images.encoder.pieces

    def failing(image):
        if image.hash == bad:
            raise RuntimeError("the tower broke")
        return (yield from pieces(image))

    images.encoder.pieces = failing
    outs = run(llm, prompts)
    assert outs[1].outputs[0].finish_reason == "error" and "the tower broke" in str(outs[1].outputs[0].stop_reason)
    assert check(outs[:1], prompts, refs, [0]) < TOL


def test_a_step_of_encoder_work_alone_keeps_the_executors_bookkeeping(vl):
    """Such a step may carry requests that finished (the last decoder ending while prompts wait at
    their images): the sampler, the request states and a proposer (draft, MTP) forget them there."""
    from ferry.core.outputs import SchedulerOutput

    path, model, prompter, prompts, refs = vl
    llm = engine(path)
    ex = llm.engine.executor
    forgotten = []

    class Proposer:
        def forget(self, out):
            forgotten.extend(out.finished_req_ids)

    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    (rid,) = ex.states.requests
    ex.mtp = Proposer()
    ids, images = prompts[0]
    result = ex.execute(SchedulerOutput(finished_req_ids=[rid], encoder_inputs=[("w", images[0], 4)]))
    assert forgotten == [rid] and rid not in ex.states.requests and result.sampled == {}
    assert 0.25 <= ex.images.jobs[images[0].hash].share < 1
