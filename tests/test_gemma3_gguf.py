"""Gemma 3 with images from the pair of files llama.cpp's converter writes: the text GGUF (arch
``gemma3``, as a text-only Gemma 3's) and the ``--mmproj`` GGUF of its SigLIP tower and projector
(projector type ``gemma3``). A tiny random Gemma3ForConditionalGeneration (float32, eager; 6 layers,
every 6th global as llama.cpp assumes; no final soft-cap, as the published configs) over SmolLM2's
vocabulary plus Gemma's image tokens, saved in the layout of the published checkpoints
(``vision_tower.vision_model.``, ``language_model.model.``), converted by convert_hf_to_gguf.py.
The pair runs as the image model: prompt logprobs and greedy tokens with one and two images equal
transformers', chunks never cut an image (its tokens attend both ways), and a Q8_0 text GGUF runs
with images close to them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.model.mmproj import find_mmproj, read_mmproj
from ferry.multimodal.processor import ImagePrompter
from tests.gguf_vl import HAVE_CONVERTER, convert, smollm2_tokenizer
from tests.vl_models import image

pytestmark = pytest.mark.skipif(not HAVE_CONVERTER, reason="no llama.cpp source tree here")

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
P = "<start_of_image>"
TOKENS = 16  # an image's soft tokens: 8 x 8 patches pooled 2 x 2
NEW = 5
TOL = 1e-4


def make_model(path: Path):
    """The model, tokenizer, image processor and processor in ``path`` (the published layout);
    returns (transformers' model, the soft image token's id)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    tok = smollm2_tokenizer(list(IMAGE_TOKENS.values()))
    tok.save_pretrained(str(path))  # reloaded with the names Gemma3Processor reads
    tok = tf.AutoTokenizer.from_pretrained(str(path), extra_special_tokens=IMAGE_TOKENS)
    boi, eoi, soft = tok.convert_tokens_to_ids(list(IMAGE_TOKENS.values()))
    cfg = tf.Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         sliding_window=6, rms_norm_eps=1e-6, query_pre_attn_scalar=16, final_logit_softcapping=None,
                         initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=TOKENS, boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration._from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):  # zeros as made; llama.cpp keeps it in float16
                p.copy_(torch.randn_like(p).mul_(0.3).half().float())
            elif "norm" in name and name.endswith("weight"):  # Gemma's (1 + w) norms start at 0, SigLIP's at 1
                p.normal_(0.0 if "language_model" in name or "mm_soft" in name else 1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    # transformers saves the tower as vision_tower.*; the published checkpoints (and llama.cpp's
    # converter) have vision_tower.vision_model.*.
    tensors = load_file(str(path / "model.safetensors"))
    hub = {("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
           for k, v in tensors.items()}
    save_file(hub, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(path))
    ip = tf.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=[0.5, 0.4, 0.3],
                                    image_std=[0.2, 0.3, 0.25])
    ip.save_pretrained(str(path))
    # Its image_seq_length tells llama.cpp's converter the projector's pooling.
    tf.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=TOKENS).save_pretrained(str(path))
    return model, soft


def hf_inputs(soft: int, prompt: list[int], images: tuple) -> dict:
    ids = torch.tensor([prompt])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": (ids == soft).long()}
    if images:
        out["pixel_values"] = torch.stack([im.data["pixel_values"] for im in images])
    return out


def hf_logprobs(model, soft: int, prompt: list[int], images: tuple) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(**hf_inputs(soft, prompt, images)).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, soft: int, prompt: list[int], images: tuple) -> list[int]:
    """transformers' NEW greedy tokens, one at a time over the whole sequence (no cache to differ)."""
    out = list(prompt)
    for _ in range(NEW):
        with torch.inference_mode():
            out.append(int(model(**hf_inputs(soft, out, images)).logits[0, -1].argmax()))
    return out[len(prompt):]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model directory, text GGUF, mmproj GGUF, transformers' model, soft token id), the GGUFs side
    by side under llama.cpp's names."""
    root = tmp_path_factory.mktemp("gemma3_gguf")
    model_dir = root / "hf"
    model, soft = make_model(model_dir)
    ggufs = root / "gguf"
    ggufs.mkdir()
    text = convert(model_dir, ggufs / "tiny-gemma3-F32.gguf", "f32")
    mmproj = convert(model_dir, ggufs / "mmproj-tiny-gemma3-F32.gguf", "f32", mmproj=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_CACHE", str(root / "cache"))
        yield model_dir, text, mmproj, model, soft


def engine(model: str, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 2, "block_size": 4, "num_kv_blocks": 64,
          "quant_activations": "exact", **kw}
    return LLM(model=model, **kw)


def prompts(prompter) -> list:
    return [prompter.encode(f"Look at {P} and say what it is", [image(64, 64, 1)]),
            prompter.encode(f"Compare {P} with {P} please", [image(40, 56, 2), image(64, 48, 3)])]


def run(llm: LLM, ps: list):
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0, logprobs=0)
    return llm.generate([p[0] for p in ps], sp, use_tqdm=False, images=[p[1] for p in ps])


def test_the_mmproj_reads_as_the_checkpoints_tower_and_image_rules(pair):
    model_dir, text, mmproj, model, soft = pair
    assert find_mmproj(text) == mmproj
    m = read_mmproj(mmproj)
    assert m.table.projector_type == "gemma3" and m.config == {"mm_tokens_per_image": TOKENS}
    state = {k.replace("model.vision_tower.", "vision_tower.vision_model.").removeprefix("model."): v
             for k, v in model.state_dict().items() if "vision_tower" in k or "multi_modal_projector" in k}
    assert set(m.tensors) == set(state)
    for name, want in state.items():
        got = torch.from_numpy(m.tensors[name])
        if name.endswith("mm_soft_emb_norm.weight"):  # stored as 1 + w: w back within float32's rounding at 1
            assert torch.allclose(got, want, atol=2e-7), name
        else:
            assert torch.equal(got, want), name
    from_dir = ImagePrompter.for_model(model_dir)
    from_gguf = ImagePrompter.for_model(model_dir, mmproj=m)
    for w, h in ((64, 64), (40, 56), (100, 36)):
        a, b = (p.process([image(w, h, 5)])[0] for p in (from_dir, from_gguf))
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def test_logprobs_and_greedy_tokens_from_gguf_and_mmproj_match_transformers(pair):
    model_dir, text, mmproj, model, soft = pair
    llm = engine(str(text))  # the mmproj is found beside the text GGUF
    assert llm.engine.executor.model_config.architecture == "Gemma3ForCausalLM"  # the text GGUF's own
    assert llm.engine.scheduler.whole_images  # the pair's image rule
    prompter = llm.engine.image_prompter
    assert prompter is not None and prompter.image_token_id == soft
    ps = prompts(prompter)
    assert [p[0] for p in ps] == [p[0] for p in prompts(ImagePrompter.for_model(model_dir))]
    steps, schedule = [], llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    worst = 0.0
    for out, (ids, ims) in zip(run(llm, ps), ps):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(model, soft, ids, ims)
        ref = hf_logprobs(model, soft, ids + tokens, ims)
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))]
                           + [out.outputs[0].logprobs[j][t] for j, t in enumerate(tokens)])
        worst = max(worst, float((got - ref).abs().max()))
    print(f"gemma3 gguf + mmproj max |d logprob| {worst:.2e}")
    assert worst < TOL
    assert llm.engine.executor.images.encoder.num_encoded == 3
    # The 16-token images ran whole past the 8-token budget.
    spans = [(im.offset, im.end) for p in ps for im in p[1]]
    assert any((c.start, c.start + c.num_tokens) in spans for s in steps for c in s.chunks)


def test_a_q8_0_text_gguf_runs_with_images_close_to_transformers(pair, tmp_path):
    model_dir, text, mmproj, model, soft = pair
    q8 = convert(model_dir, tmp_path / "tiny-gemma3-Q8_0.gguf", "q8_0")
    assert engine(str(q8)).engine.image_prompter is None  # no mmproj beside it: its text alone runs
    llm = engine(str(q8), mmproj=str(mmproj))
    ps = prompts(llm.engine.image_prompter)
    worst = 0.0
    for out, (ids, ims) in zip(run(llm, ps), ps):
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        worst = max(worst, float((got - hf_logprobs(model, soft, ids, ims)).abs().max()))
    print(f"gemma3 Q8_0 gguf + mmproj max |d prompt logprob| {worst:.2e}")
    assert 0 < worst < 0.3


def test_an_mmproj_of_another_family_is_refused(pair, tmp_path):
    model_dir, text, mmproj, model, soft = pair
    with pytest.raises(ValueError, match="takes no images"):
        engine(None, mmproj=str(mmproj))  # the embedded text model (llama)
