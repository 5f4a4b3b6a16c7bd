"""SmolVLM with images from the pair of files llama.cpp's converter writes: the text GGUF (arch
``llama``, as SmolVLM's language model is) and the ``--mmproj`` GGUF of its SigLIP tower and
pixel-shuffle connector (projector type ``idefics3``). The tiny random SmolVLM of
``tests.test_smolvlm`` over SmolLM2's vocabulary plus SmolVLM's image tokens (its own tokenizer),
config.json naming its text model ``VLlama3ForCausalLM`` as the published one does, converted by
convert_hf_to_gguf.py. The pair runs as the image model: prompt logprobs and greedy tokens with
split images (2 x 2 tiles plus the global one) and two images equal transformers', with chunks that
cut the tiles' spans."""
from __future__ import annotations

import json

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.multimodal.processor import ImagePrompter
from tests.gguf_vl import HAVE_CONVERTER, convert, smollm2_tokenizer
from tests.test_smolvlm import ROWCOL, hf_greedy, hf_logprobs, make_model
from tests.vl_models import image

pytestmark = pytest.mark.skipif(not HAVE_CONVERTER, reason="no llama.cpp source tree here")

TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *ROWCOL]
NEW = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model directory, text GGUF, transformers' model), the mmproj beside the text GGUF."""
    root = tmp_path_factory.mktemp("smolvlm_gguf")
    model_dir = root / "hf"
    model_dir.mkdir()
    model, _ = make_model(model_dir, tokenizer=smollm2_tokenizer(TOKENS), tile=48)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["text_config"]["architectures"] = ["VLlama3ForCausalLM"]  # what llama.cpp's converter reads
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ggufs = root / "gguf"
    ggufs.mkdir()
    text = convert(model_dir, ggufs / "tiny-smolvlm-F32.gguf", "f32")
    convert(model_dir, ggufs / "mmproj-tiny-smolvlm-F32.gguf", "f32", mmproj=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_CACHE", str(root / "cache"))
        yield model_dir, text, model


def test_logprobs_and_greedy_tokens_from_gguf_and_mmproj_match_transformers(pair):
    model_dir, text, model = pair
    llm = LLM(model=str(text), max_num_batched_tokens=8, max_num_seqs=2, block_size=4, num_kv_blocks=96,
              quant_activations="exact")
    assert llm.engine.executor.model_config.architecture == "LlamaForCausalLM"  # the text GGUF's own
    prompter = llm.engine.image_prompter
    assert prompter is not None and prompter.image_seq_len == 9  # (48 / 8)**2 / 2**2, from the mmproj
    texts = ["Look at <image> and say what it is", "Compare <image> with <image> please"]
    pictures = [[image(96, 96, 1)], [image(96, 48, 2), image(48, 72, 3)]]
    ps = [prompter.encode(t, p) for t, p in zip(texts, pictures)]
    from_dir = ImagePrompter.for_model(model_dir)
    for (ids, tiles), t, p in zip(ps, texts, pictures):
        ref_ids, ref_tiles = from_dir.encode(t, p)
        assert ids == ref_ids
        assert all(torch.equal(a.data["pixel_values"], b.data["pixel_values"]) for a, b in zip(tiles, ref_tiles))
    assert len(ps[0][1]) == 5  # 2 x 2 tiles and the global image
    steps, schedule = [], llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0, logprobs=0)
    worst = 0.0
    for out, (ids, tiles) in zip(llm.generate([p[0] for p in ps], sp, use_tqdm=False, images=[p[1] for p in ps]), ps):
        ref_tokens, ref_decode = hf_greedy(model, ids, tiles, NEW)
        assert list(out.outputs[0].token_ids) == ref_tokens
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        dec = torch.tensor([out.outputs[0].logprobs[j][t] for j, t in enumerate(ref_tokens)])
        worst = max(worst, float((got - hf_logprobs(model, ids, tiles)).abs().max()),
                    float((dec - ref_decode).abs().max()))
    print(f"smolvlm gguf + mmproj max |d logprob| {worst:.2e}")
    assert worst < TOL
    spans = [(t.offset, t.end) for p in ps for t in p[1]]
    ends = [c.start + c.num_tokens for s in steps for c in s.chunks]
    assert any(a < e < b for a, b in spans for e in ends)  # some chunk ended inside a tile
    assert llm.engine.executor.images.encoder.num_encoded == len(spans)
