"""SmolVLM and Idefics3 against transformers' SmolVLMForConditionalGeneration /
Idefics3ForConditionalGeneration: tiny random models made by transformers (float32, eager; a 2-layer
SigLIP tower whose position table (6 x 6) is larger than a tile's 4 x 4 patches, so the bucketed
position ids matter) with their image processor and processor configs saved beside them, and
32..64-pixel images split into 32-pixel tiles plus a global tile. Prompt ids and pixels equal the
transformers processor's; prompt logprobs, greedy tokens and their logprobs through ferry.LLM with
one and two images, chunks that cut the tiles' spans, preemption, the prefix cache, and LLM.chat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.multimodal.processor import ImagePrompter
from tests.vl_models import NEW, check, image, run

IMAGE, FAKE, GLOBAL, EOU, NL = 300, 301, 302, 303, 304
SPECIALS = {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL, "<end_of_utterance>": EOU}
ROWCOL = {f"<row_{i}_col_{j}>": 305 + (i - 1) * 6 + (j - 1) for i in range(1, 7) for j in range(1, 7)}
EOS, VOCAB = 349, 352
SEQ = 4  # tokens per tile: (32 / 8)**2 patches / 2**2
TOL = 1e-4
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %} {{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %} <image>{% else %} {{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %} <end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def save_tokenizer(path: Path):
    """A word-level tokenizer ("w5" is token 5) with Idefics3's image tokens, the row/column markers
    and "\\n" as tokens of their own, and a small chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(IMAGE)}
    vocab.update({**SPECIALS, "\n": NL, **ROWCOL, "<|endoftext|>": EOS})
    vocab.update({f"x{i}": i for i in range(EOS + 1, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken(t, normalized=False) for t in ["\n", *ROWCOL]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIALS), chat_template=TEMPLATE)
    fast.save_pretrained(str(path))
    return fast


def make_model(path: Path, family: str = "smolvlm", split: bool = True, tokenizer=None, tile: int = 32):
    """The model, tokenizer, image processor and processor configs in ``path``; returns
    (transformers' model, transformers' processor) for reference. ``tokenizer``: one with the
    image tokens in place of the word-level one (``save_tokenizer``); ``tile``: the image processor's
    tile side (llama.cpp takes the tower's 48)."""
    import transformers as tf

    tok = save_tokenizer(path) if tokenizer is None else tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    text = dict(model_type="llama", vocab_size=max(tok.get_vocab().values()) + 1, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.2, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=48,
                  patch_size=8, initializer_range=0.2)
    Config, Model, Images = {"smolvlm": (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration, tf.SmolVLMImageProcessor),
                             "idefics3": (tf.Idefics3Config, tf.Idefics3ForConditionalGeneration,
                                          tf.Idefics3ImageProcessor)}[family]
    cfg = Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=image_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Model._from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.3)  # moved away from 1 and 0, so a missing norm or bias changes the output
            elif name.endswith("bias") or "position_embedding" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(str(path))
    images = Images(do_image_splitting=split, max_image_size={"longest_edge": tile}, size={"longest_edge": 2 * tile})
    images.save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": (tile // 8) ** 2 // 4}))
    return model, reference_processor(family, images, tok)


def reference_processor(family: str, images, tok):
    """transformers' processor of the family, built without SmolVLM's video side (torchvision, num2words)."""
    import transformers.models.smolvlm.processing_smolvlm as smol
    from transformers import Idefics3Processor

    if family == "idefics3":
        return Idefics3Processor(images, tok, image_seq_len=SEQ)

    class Processor(smol.SmolVLMProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None

    was, smol.num2words = smol.num2words, str
    try:
        return Processor(images, tok, SimpleNamespace(num_frames=1, fps=1), image_seq_len=SEQ)
    finally:
        smol.num2words = was


def hf_inputs(prompt: list[int], tiles: tuple) -> dict:
    """transformers' model inputs for a prompt and its tiles' ImageFeatures."""
    ids = torch.tensor([prompt])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if tiles:
        out["pixel_values"] = torch.stack([t.data["pixel_values"] for t in tiles])[None]
        out["pixel_attention_mask"] = torch.stack([t.data["pixel_attention_mask"] for t in tiles])[None]
    return out


def hf_logprobs(model, prompt: list[int], tiles: tuple) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(**hf_inputs(prompt, tiles)).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], tiles: tuple, n: int) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        gen = model.generate(**hf_inputs(prompt, tiles), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    tokens = gen[0, len(prompt):].tolist()
    return tokens, hf_logprobs(model, prompt + tokens, tiles)[-n:]


def references(model, prompts) -> list:
    return [(hf_logprobs(model, ids, tiles), *hf_greedy(model, ids, tiles, NEW)) for ids, tiles in prompts]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    path = tmp_path_factory.mktemp("smolvlm")
    model, processor = make_model(path)
    prompter = ImagePrompter.for_model(path)
    prompts = [prompter.encode("w5 w7 <image> w9 w11 w13 w2", [image(64, 64, 1)]),  # 2 x 2 tiles + global
               prompter.encode("w5 w8 <image> w9 w11 <image> w3 w4", [image(64, 32, 2), image(32, 48, 3)]),
               prompter.encode("w5 w7 w9 w11 w13 w2 w17", [])]  # text alone
    return path, model, processor, prompter, prompts, references(model, prompts)


def engine(path, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "block_size": 4, "num_kv_blocks": 96,
          "enable_prefix_caching": True, **kw}
    return LLM(model=str(path), quant_activations="exact", **kw)




def test_prompt_ids_and_pixels_equal_the_transformers_processor(smol):
    path, model, processor, prompter, prompts, refs = smol
    texts = ["w5 w7 <image> w9 w11 w13 w2", "w5 w8 <image> w9 w11 <image> w3 w4"]
    pictures = [[image(64, 64, 1)], [image(64, 32, 2), image(32, 48, 3)]]
    for text, pics, (ids, tiles) in zip(texts, pictures, prompts):
        ref = processor(text=[text], images=[pics], return_tensors="pt", add_special_tokens=False)
        assert ids == ref["input_ids"][0].tolist()
        assert torch.equal(torch.stack([t.data["pixel_values"] for t in tiles]), ref["pixel_values"][0])
        assert all(ids[t.offset:t.end] == [IMAGE] * SEQ for t in tiles)
        assert sum(t.length for t in tiles) == ids.count(IMAGE)
    ids, tiles = prompts[0]
    # 2 x 2 tiles, then the global image: <fake><row_i_col_j> before each tile, "\n" after each row.
    assert len(tiles) == 5 and ids[2:4] == [FAKE, ROWCOL["<row_1_col_1>"]]
    assert ids[tiles[-1].offset - 4:tiles[-1].offset] == [NL, NL, FAKE, GLOBAL] and ids[tiles[-1].end] == FAKE
    assert len({t.hash for t in tiles}) == 5
    again = prompter.encode("w1 <image>", [image(64, 64, 1)])[1]
    assert [t.hash for t in again] == [t.hash for t in tiles]
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        prompter.encode("w1 <image>", [image(32, 32, 2), image(32, 32, 3)])


def test_logprobs_and_greedy_tokens_match_transformers_with_chunks_cutting_tiles(smol):
    path, model, processor, prompter, prompts, refs = smol
    llm = engine(path)
    steps, schedule = [], llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    diff = check(run(llm, prompts), prompts, refs)
    print(f"smolvlm max |d logprob| {diff:.2e}")
    assert diff < TOL
    # Some chunk ended inside a tile's span, and each tile was encoded once for all its chunks.
    spans = [(t.offset, t.end) for p in prompts[:2] for t in p[1]]
    ends = [c.start + c.num_tokens for s in steps for c in s.chunks]
    assert any(off < e < end for off, end in spans for e in ends)
    assert llm.engine.executor.images.encoder.num_encoded == len(spans)
    check(run(llm, prompts, [2]), prompts, refs, [2])
    assert llm.engine.executor.images.cache == {} and llm.engine.scheduler.encoder_refs == {}


def test_preempted_requests_recompute_their_tiles(smol):
    path, model, processor, prompter, prompts, refs = smol
    llm = engine(path, num_kv_blocks=20)
    assert check(run(llm, prompts), prompts, refs) < TOL
    assert llm.engine.num_preemptions > 0


def test_prefix_cache_blocks_hold_the_tile_hash(smol):
    path, model, processor, prompter, prompts, refs = smol
    llm = engine(path)
    kv = llm.engine.scheduler.kv
    # The same text with another image of the same size: no block holding a tile token is shared.
    text = "<image> w9 w11 w13 w2"
    first = prompter.encode(text, [image(64, 64, 1)])
    other = prompter.encode(text, [image(64, 64, 9)])
    assert other[0] == first[0] and first[1][0].offset < 4  # the first block holds a tile's tokens
    other_ref = hf_greedy(model, *other, NEW)[0]
    first_ref = hf_greedy(model, *first, NEW)
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    llm.generate([first[0]], sp, use_tqdm=False, images=[first[1]])
    hits = kv.num_hit_tokens
    out = llm.generate([other[0]], sp, use_tqdm=False, images=[other[1]])
    assert kv.num_hit_tokens == hits
    assert out[0].outputs[0].token_ids == other_ref
    # The same image again: its blocks are found, and the tokens are still transformers'.
    out = llm.generate([first[0]], sp, use_tqdm=False, images=[first[1]])
    assert kv.num_hit_tokens > hits
    assert out[0].outputs[0].token_ids == first_ref[0]
    got = torch.tensor([out[0].outputs[0].logprobs[j][t] for j, t in enumerate(first_ref[0])])
    assert float((got - first_ref[1]).abs().max()) < TOL


def test_an_image_through_llm_chat(smol):
    path, model, processor, prompter, prompts, refs = smol
    llm = engine(path, max_num_batched_tokens=64)
    conv = [{"role": "user", "content": [{"type": "image", "image": image(64, 32, 2)},
                                         {"type": "text", "text": "w9 w11"}]}]
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    out = llm.chat(conv, sp, use_tqdm=False)[0]
    ids, tiles = prompter.encode("user: <image> w9 w11 <end_of_utterance>\nassistant:", [image(64, 32, 2)])
    assert out.prompt_token_ids == ids and len(tiles) == 3  # 1 x 2 tiles + global
    assert out.outputs[0].token_ids == hf_greedy(model, ids, tiles, NEW)[0]


def test_idefics3_without_splitting_matches_transformers(tmp_path):
    model, processor = make_model(tmp_path, "idefics3", split=False)
    prompter = ImagePrompter.for_model(tmp_path)
    texts = ["w5 w7 <image> w9 w11 w13 w2", "w5 w8 <image> w9 w11 <image> w3 w4"]
    pictures = [[image(64, 64, 1)], [image(64, 32, 2), image(32, 48, 3)]]
    prompts = [prompter.encode(t, p) for t, p in zip(texts, pictures)]
    for text, pics, (ids, tiles) in zip(texts, pictures, prompts):
        assert ids == processor(text=[text], images=[pics], add_special_tokens=False)["input_ids"][0]
        assert len(tiles) == len(pics)  # the global image alone
    llm = engine(tmp_path)
    diff = check(run(llm, prompts), prompts, references(model, prompts))
    print(f"idefics3 max |d logprob| {diff:.2e}")
    assert diff < TOL


from tests.llama_cpp import LLAMA_CPP  # noqa: E402


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="no llama.cpp source tree here")
def test_the_mmproj_of_llama_cpp_reads_as_the_same_tower(smol, tmp_path):
    """llama.cpp's ``--mmproj`` GGUF (projector type idefics3): its tensors by checkpoint name equal the
    checkpoint's, and its tower and connector encode tiles as transformers does."""
    from safetensors.torch import load_file

    from ferry.model.idefics3_images import Idefics3Encoder
    from ferry.model.mmproj import read_mmproj

    path, model, processor, prompter, prompts, refs = smol
    out = tmp_path / "mmproj-smol.gguf"
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(path), "--outtype", "f32",
                    "--outfile", str(out), "--mmproj"], env=dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py")),
                   check=True, capture_output=True, timeout=300)
    mm = read_mmproj(out)
    ckpt = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
            if k.startswith(("model.vision_model.", "model.connector."))}
    assert sorted(mm.tensors) == sorted(ckpt)
    assert all(torch.equal(torch.from_numpy(mm.tensors[k]), v) for k, v in ckpt.items())
    assert mm.config == {"scale_factor": 2} and mm.preprocessor["size"] == {"longest_edge": 64}
    encoder = Idefics3Encoder.load(path, torch.float32, torch.device("cpu"), mm)
    tiles = prompts[1][1]
    got = torch.cat([encoder.encode(t).embeds for t in tiles])
    with torch.inference_mode():
        inputs = hf_inputs(prompts[1][0], tiles)
        ref = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output
    assert float((got - torch.cat(list(ref))).abs().max()) < 1e-5
