"""Gemma 3 with images against transformers' Gemma3ForConditionalGeneration: a tiny random model made
by transformers (float32, eager; a 2-layer SigLIP tower of 8x8 patches over 64x64 pixels, pooled to
16 tokens an image; a 3-layer language model whose windowed layers see 6 tokens) with its processor
saved beside it, and small images. The prompter's ids and pixels equal Gemma3Processor's; prompt
logprobs and greedy tokens with one and two images equal transformers' (whose image tokens attend
to each other both ways); small token budgets end chunks before an image, never inside one;
preemption; prefix-cache keys that hold the image's hash."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.multimodal.processor import ImagePrompter
from tests.vl_models import NEW, check, image, record, run

BOI, EOI, SOFT, BREAK = 300, 301, 302, 303
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_image>": BOI, "<end_of_image>": EOI,
            "<image_soft_token>": SOFT}
P = "<start_of_image>"
TOKENS = 16  # an image's soft tokens
TOL = 1e-4


def save_tokenizer(path: Path):
    """A word-level tokenizer ("w5" is token 5) with Gemma 3's image tokens and "\\n\\n" as a token."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(3, BOI)}
    vocab.update({f"x{i}": i for i in range(BREAK + 1, 320)})
    vocab.update(SPECIALS)
    vocab["\n\n"] = BREAK
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                         "image_token": "<image_soft_token>"})
    fast.save_pretrained(str(path))
    return fast


def make_gemma3_model(path: Path):
    """The model, its tokenizer, image processor and processor saved in ``path``; transformers' model returned."""
    import transformers as tf

    cfg = tf.Gemma3Config(
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rms_norm_eps=1e-6, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                         initializer_range=0.2, bos_token_id=2, eos_token_id=1, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=TOKENS, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT,
        eos_token_id=1)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration._from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):  # zeros as made
                p.normal_(0.0, 0.3)
            elif "norm" in name and name.endswith("weight"):  # Gemma's (1 + w) norms start at 0, SigLIP's at 1
                p.normal_(0.0 if "language_model" in name or "mm_soft" in name else 1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    fast = save_tokenizer(path)
    ip = tf.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    ip.save_pretrained(str(path))
    tf.Gemma3Processor(image_processor=ip, tokenizer=fast, image_seq_length=TOKENS).save_pretrained(str(path))
    return model


def hf_inputs(prompt: list[int], images: tuple) -> dict:
    ids = torch.tensor([prompt])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": (ids == SOFT).long()}
    if images:
        out["pixel_values"] = torch.stack([im.data["pixel_values"] for im in images])
    return out


def hf_logprobs(model, prompt: list[int], images: tuple) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(**hf_inputs(prompt, images)).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], images: tuple, n: int) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        gen = model.generate(**hf_inputs(prompt, images), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    tokens = gen[0, len(prompt):].tolist()
    return tokens, hf_logprobs(model, prompt + tokens, images)[-n:]


@pytest.fixture(scope="module")
def g3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision")
    model = make_gemma3_model(path)
    prompter = ImagePrompter.for_model(path)
    prompts = [prompter.encode(f"<bos>w5 w7 {P} w9 w11 w13 w4", [image(64, 64, 1)]),
               prompter.encode(f"<bos>w6 w8 {P} w9 w11 {P} w3 w4", [image(40, 56, 2), image(64, 48, 3)]),
               prompter.encode("<bos>w8 w7 w9 w11 w13 w4 w17", [])]
    refs = [(hf_logprobs(model, ids, ims), *hf_greedy(model, ids, ims, NEW)) for ids, ims in prompts]
    return path, model, prompter, prompts, refs


def engine(path, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 64, "max_num_seqs": 3, "block_size": 4, "num_kv_blocks": 64,
          "enable_prefix_caching": True, **kw}
    return LLM(model=str(path), quant_activations="exact", **kw)





def test_the_prompter_gives_gemma3_processors_ids_and_pixels(g3):
    from transformers import AutoProcessor

    path, model, prompter, prompts, refs = g3
    ids, images = prompts[1]
    text = f"<bos>w6 w8 {P} w9 w11 {P} w3 w4"
    hf = AutoProcessor.from_pretrained(str(path))(text=[text], images=[[image(40, 56, 2), image(64, 48, 3)]],
                                                  return_tensors="pt", add_special_tokens=False)
    assert ids == hf["input_ids"][0].tolist()
    spans = [(im.offset, im.length) for im in images]
    mask = [any(o <= i < o + n for o, n in spans) for i in range(len(ids))]
    assert mask == [bool(t) for t in hf["token_type_ids"][0].tolist()]
    assert ids[spans[0][0] - 2:spans[0][0]] == [BREAK, BOI] and spans[1][1] == TOKENS
    assert torch.equal(torch.stack([im.data["pixel_values"] for im in images]), hf["pixel_values"])
    assert images[0].hash != images[1].hash
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        prompter.encode(f"w1 {P}", [image(32, 32, 2), image(32, 32, 3)])


def test_logprobs_and_greedy_tokens_match_transformers(g3):
    path, model, prompter, prompts, refs = g3
    llm = engine(path)
    assert llm.engine.scheduler.whole_images
    diff = check(run(llm, prompts), prompts, refs)
    print(f"gemma3 with images max |d logprob| {diff:.2e}")
    assert diff < TOL


def test_chunks_end_before_an_image_and_never_inside_one(g3):
    path, model, prompter, prompts, refs = g3
    llm = engine(path, max_num_batched_tokens=8)  # the 16-token images are larger than the budget
    steps = record(llm)
    assert check(run(llm, prompts), prompts, refs) < TOL
    spans = {}
    for i, (ids, images) in enumerate(prompts):
        spans[i] = [(im.offset, im.end) for im in images]
    rids = {}
    for s in steps:
        for c in s.chunks:
            rids.setdefault(c.request_id, len(rids))
    chunks = [(rids[c.request_id], c.start, c.start + c.num_tokens) for s in steps for c in s.chunks]
    for i, start, end in chunks:
        assert not any(a < end < b or a < start < b for a, b in spans[i]), (i, start, end)
    # Chunks did end right before an image, and an image ran whole past the step's budget.
    assert any(end == a for i, _, end in chunks for a, _ in spans[i])
    assert any(start == a and end == b for i, start, end in chunks for a, b in spans[i])


def test_preempted_requests_recompute_their_images(g3):
    path, model, prompter, prompts, refs = g3
    llm = engine(path, num_kv_blocks=20, max_num_batched_tokens=24)
    assert check(run(llm, prompts), prompts, refs) < TOL
    assert llm.engine.num_preemptions > 0


def test_prefix_cache_blocks_hold_the_image_hash(g3):
    path, model, prompter, prompts, refs = g3
    llm = engine(path)
    kv = llm.engine.scheduler.kv
    other = prompter.encode(f"<bos>w5 w7 {P} w9 w11 w13 w4", [image(64, 64, 9)])
    assert other[0] == prompts[0][0]
    other_refs = (hf_logprobs(model, *other), *hf_greedy(model, *other, NEW))
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    llm.generate([prompts[0][0]], sp, use_tqdm=False, images=[prompts[0][1]])
    hits = kv.num_hit_tokens
    # The same text with another image shares only the whole blocks before the image.
    out = llm.generate([other[0]], sp, use_tqdm=False, images=[other[1]])
    assert kv.num_hit_tokens - hits == other[1][0].offset // 4 * 4 == 4
    assert out[0].outputs[0].token_ids == other_refs[1]
    # The same image again: its blocks are found, and the tokens are still transformers'.
    out = llm.generate([prompts[0][0]], sp, use_tqdm=False, images=[prompts[0][1]])
    assert kv.num_hit_tokens > hits
    assert out[0].outputs[0].token_ids == refs[0][1]
    got = torch.tensor([out[0].outputs[0].logprobs[j][t] for j, t in enumerate(refs[0][1])])
    assert float((got - refs[0][2]).abs().max()) < TOL
