"""Qwen3-VL from the pair of files llama.cpp's converter writes: the text GGUF (arch ``qwen3vl``) and
the ``--mmproj`` GGUF of its vision tower (projector ``qwen3vl_merger``, deepstack mergers included).
A tiny random Qwen3VLForConditionalGeneration (float32, eager) with SmolLM2's tokenizer plus Qwen's
vision tokens, converted by convert_hf_to_gguf.py; the image rules come from the mmproj's metadata,
the tokenizer from the text GGUF. Prompt logprobs and greedy tokens with one and two images against
transformers (F32), and a Q8_0 text GGUF that runs with images close to them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.model.gguf_convert import default_cache_dir
from ferry.model.mmproj import find_mmproj, read_mmproj
from ferry.multimodal.processor import ImagePrompter
from tests.gguf_vl import HAVE_CONVERTER, convert
from tests.vl_models import CHAT_TEMPLATE, hf_config, image

pytestmark = pytest.mark.skipif(not HAVE_CONVERTER, reason="no llama.cpp source tree here")

P = "<|vision_start|><|image_pad|><|vision_end|>"
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
NEW = 5
TOL = 1e-4


def make_model(path: Path):
    """The tiny Qwen3-VL of ``tests.vl_models`` over SmolLM2's vocabulary (a tokenizer llama.cpp's
    converter knows) plus the vision tokens; the image processor's limits are llama.cpp's defaults
    (8 to 4096 tokens) so the directory's rules and the mmproj's agree; a chat template of Qwen's image
    placeholder (the converter writes it into the text GGUF) so a chat with images renders."""
    import transformers as tf

    from ferry.model.loader import resolve_model_dir

    tok = tf.AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    tok.add_special_tokens({"additional_special_tokens": VISION})
    ids = tok.convert_tokens_to_ids(VISION)
    cfg = hf_config()
    cfg.text_config.vocab_size = 49216
    cfg.text_config.eos_token_id = tok.eos_token_id
    cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id = ids[1], ids[0], ids[2], ids[3]
    torch.manual_seed(0)
    model = tf.Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    tf.Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.4, 0.3],
                             image_std=[0.2, 0.3, 0.25],
                             size={"shortest_edge": 8 * 256, "longest_edge": 4096 * 256}).save_pretrained(str(path))
    return model, ids[1]


def hf_logprobs(model, pad: int, prompt: list[int], images: tuple) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the ones before it."""
    ids = torch.tensor([prompt])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int()}
    if images:
        kw["pixel_values"] = torch.cat([im.data["pixel_values"] for im in images])
        kw["image_grid_thw"] = torch.stack([torch.as_tensor(im.data["image_grid_thw"]) for im in images])
    with torch.inference_mode():
        logits = model(**kw).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, pad: int, prompt: list[int], images: tuple) -> list[int]:
    """transformers' NEW greedy tokens, one at a time over the whole sequence (no cache to differ)."""
    out = list(prompt)
    for _ in range(NEW):
        with torch.inference_mode():
            ids = torch.tensor([out])
            kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int(),
                  "pixel_values": torch.cat([im.data["pixel_values"] for im in images]),
                  "image_grid_thw": torch.stack([torch.as_tensor(im.data["image_grid_thw"]) for im in images])}
            out.append(int(model(**kw).logits[0, -1].argmax()))
    return out[len(prompt):]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model directory, text GGUF, mmproj GGUF, transformers' model, image pad id); the GGUFs side
    by side under llama.cpp's names, so the mmproj is found beside the text file."""
    root = tmp_path_factory.mktemp("qwen3vl_gguf")
    model_dir = root / "hf"
    model, pad = make_model(model_dir)
    ggufs = root / "gguf"
    ggufs.mkdir()
    text = convert(model_dir, ggufs / "tiny-qwen3vl-F32.gguf", "f32")
    mmproj = convert(model_dir, ggufs / "mmproj-tiny-qwen3vl-F32.gguf", "f32", mmproj=True)
    # The converted models go to a cache of their own; the C kernels (keyed by their source's hash)
    # are the ones already built, so neither this process nor a server it starts builds them again.
    kernels = default_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir()
    (root / "cache" / "kernels").symlink_to(kernels)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_CACHE", str(root / "cache"))
        yield model_dir, text, mmproj, model, pad


def engine(model: str, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 2, "block_size": 4, "num_kv_blocks": 64,
          "quant_activations": "exact", **kw}
    return LLM(model=model, **kw)


def prompts(prompter: ImagePrompter) -> list:
    return [prompter.encode(f"Look at {P} and say what it is", [image(64, 64, 1)]),  # 16 image tokens
            prompter.encode(f"Compare {P} with {P} please", [image(48, 64, 2), image(64, 48, 3)])]  # 12 and 12


def run(llm: LLM, ps: list):
    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0, logprobs=0)
    return llm.generate([p[0] for p in ps], sp, use_tqdm=False, images=[p[1] for p in ps])


def prompt_diff(out, ids: list[int], ref: torch.Tensor) -> float:
    got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
    return float((got - ref).abs().max())


def test_the_mmproj_reads_as_the_checkpoints_tower_and_image_rules(pair):
    model_dir, text, mmproj, model, pad = pair
    assert find_mmproj(text) == mmproj and find_mmproj(mmproj) is None
    m = read_mmproj(mmproj)
    assert m.table.projector_type == "qwen3vl_merger"
    assert m.vision_config["deepstack_visual_indexes"] == [0, 1]
    state = {k: v for k, v in model.state_dict().items() if k.startswith("model.visual.")}
    assert set(m.tensors) == set(state)  # every tensor, deepstack mergers and the patch Conv3d included
    for name, want in state.items():
        assert torch.equal(torch.from_numpy(m.tensors[name]), want), name
    # The image processor's rules from the mmproj equal the directory's: the same pixels, token for token.
    from_dir = ImagePrompter.for_model(model_dir)
    from_gguf = ImagePrompter.for_model(model_dir, preprocessor=m.preprocessor)
    for w, h in ((64, 64), (48, 64), (100, 36)):
        a, b = (p.process([image(w, h, 5)])[0] for p in (from_dir, from_gguf))
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])


def test_logprobs_and_greedy_tokens_from_gguf_and_mmproj_match_transformers(pair):
    model_dir, text, mmproj, model, pad = pair
    llm = engine(str(text))  # the mmproj is found beside the text GGUF
    prompter = llm.engine.image_prompter
    assert prompter is not None and prompter.image_token_id == pad
    ps = prompts(prompter)
    # The tokenizer from the text GGUF splits the text as the checkpoint's does.
    assert ps[0][0] == ImagePrompter.for_model(model_dir).encode(f"Look at {P} and say what it is",
                                                                 [image(64, 64, 1)])[0]
    worst = 0.0
    for out, (ids, ims) in zip(run(llm, ps), ps):
        full = ids + list(out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == hf_greedy(model, pad, ids, ims)
        ref = hf_logprobs(model, pad, full, ims)
        worst = max(worst, prompt_diff(out, ids, ref[:len(ids) - 1]))
        dec = torch.tensor([out.outputs[0].logprobs[j][t] for j, t in enumerate(out.outputs[0].token_ids)])
        worst = max(worst, float((dec - ref[len(ids) - 1:]).abs().max()))
    print(f"qwen3-vl gguf + mmproj max |d logprob| {worst:.2e}")
    assert worst < TOL
    assert llm.engine.executor.images.encoder.num_encoded == 3


def test_a_q8_0_text_gguf_runs_with_images_close_to_transformers(pair, tmp_path):
    model_dir, text, mmproj, model, pad = pair
    q8 = convert(model_dir, tmp_path / "tiny-Q8_0.gguf", "q8_0")
    alone = engine(str(q8))  # no mmproj beside it: its text alone runs
    assert alone.engine.image_prompter is None
    llm = engine(str(q8), mmproj=str(mmproj))
    ps = prompts(llm.engine.image_prompter)
    worst = 0.0
    for out, (ids, ims) in zip(run(llm, ps), ps):
        worst = max(worst, prompt_diff(out, ids, hf_logprobs(model, pad, ids, ims)))
    print(f"qwen3-vl Q8_0 gguf + mmproj max |d prompt logprob| {worst:.2e}")
    assert 0 < worst < 0.3


def test_an_mmproj_for_a_text_model_is_refused(pair):
    model_dir, text, mmproj, model, pad = pair
    with pytest.raises(ValueError, match="takes no images"):
        engine(None, mmproj=str(mmproj))
