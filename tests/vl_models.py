"""A tiny random Qwen3-VL (and Qwen3.5 with its vision tower) made by transformers (float32, eager), with a word-level tokenizer
("w5" is token 5) holding Qwen's vision tokens and an image processor config of small pixel
limits saved beside it; transformers' own logprobs and greedy tokens for prompts with images
(a test helper)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
VISION_START, IMAGE_PAD, VIDEO_PAD, VISION_END, EOS = 300, 301, 302, 303, 319
SPECIALS = {"<|vision_start|>": VISION_START, "<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD,
            "<|vision_end|>": VISION_END, "<|endoftext|>": EOS}
# A small chat template of Qwen's image placeholder: each image part, its vision tokens.
CHAT_TEMPLATE = """{%- for m in messages -%}
{%- if m.content is string -%}{{ m.content }} {% else -%}
{%- for part in m.content -%}
{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|> {% else -%}{{ part.text }} {% endif -%}
{%- endfor -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}w1 {% endif -%}"""


def hf_config():
    import transformers as tf

    return tf.Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=EOS,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], initializer_range=0.2),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False, eos_token_id=EOS)


def save_tokenizer(path: Path) -> None:
    """tokenizer.json (and its config): "w0".."w299" split on whitespace, the special tokens as added ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VISION_START)}
    vocab.update({f"x{i}": i for i in range(304, EOS)})
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=[t for t in SPECIALS if t != "<|endoftext|>"])
    fast.save_pretrained(str(path))


def make_vl_model(path: Path):
    """The model, tokenizer and image processor saved in ``path``; transformers' model returned (eval)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3VLForConditionalGeneration._from_config(hf_config(), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            _perturb_vision(name, p)
    _save(model, path)
    return model


def make_qwen3_5_vl_model(path: Path):
    """Qwen3.5 (Gated DeltaNet and gated attention layers, partial multimodal rope) with a 2-block
    vision tower (no deepstack), as ``make_vl_model`` saves it; transformers' model returned (eval)."""
    import transformers as tf

    from tests.test_hybrid_qwen3_5 import COMMON, perturb

    rope = dict(COMMON["rope_parameters"], mrope_section=[1, 1, 2], mrope_interleaved=True)
    cfg = tf.Qwen3_5Config(text_config=dict(COMMON, rope_parameters=rope, eos_token_id=EOS),
                           vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                                              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                              num_position_embeddings=16, initializer_range=0.2),
                           image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name:
                perturb(name, p)
            else:
                _perturb_vision(name, p)
    _save(model, path)
    return model


def _perturb_vision(name: str, p: torch.Tensor) -> None:
    """Norm weights and biases moved away from 1 and 0, so a missing one changes the output."""
    if "norm" in name and name.endswith("weight"):
        p.normal_(1.0, 0.3)
    elif name.endswith("bias"):
        p.normal_(0.0, 0.3)


def _save(model, path: Path) -> None:
    """The model, the tokenizer and the image processor config (small pixel limits) in ``path``."""
    import transformers as tf

    model.save_pretrained(path)
    save_tokenizer(path)
    proc = tf.Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    proc.save_pretrained(str(path))


def image(w: int, h: int, k: int):
    """A deterministic RGB test image of w x h pixels (pattern ``k``)."""
    from PIL import Image

    g = torch.Generator().manual_seed(k)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def hf_inputs(prompt: list[int], images: tuple) -> dict:
    """transformers' model inputs for a prompt of expanded placeholders and its ImageFeatures."""
    ids = torch.tensor([prompt])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE_PAD).int()}
    if images:
        out["pixel_values"] = torch.cat([im.data["pixel_values"] for im in images])
        out["image_grid_thw"] = torch.stack([torch.as_tensor(im.data["image_grid_thw"]) for im in images])
    return out


def hf_logprobs(model, prompt: list[int], images: tuple) -> torch.Tensor:
    """[len(prompt) - 1] transformers' log-probability of each prompt token after the ones before it."""
    with torch.inference_mode():
        logits = model(**hf_inputs(prompt, images)).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], images: tuple, n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' n greedy tokens, and the logprob of each after the ones before it (one pass)."""
    with torch.inference_mode():
        gen = model.generate(**hf_inputs(prompt, images), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    tokens = gen[0, len(prompt):].tolist()
    return tokens, hf_logprobs(model, prompt + tokens, images)[-n:]


# The new tokens each engine run of these tests generates (greedy, every one checked).
NEW = 6


def record(llm) -> list:
    """Every scheduler output of ``llm`` from now on."""
    outs, schedule = [], llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        outs.append(out)
        return out

    llm.engine.scheduler.schedule = spy
    return outs


def run(llm, prompts, which=None) -> list:
    """``llm``'s outputs for prompts (ids, images) ``which`` (all): NEW greedy tokens, logprobs of the prompt and them."""
    from ferry import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0, logprobs=0)
    which = range(len(prompts)) if which is None else which
    return llm.generate([prompts[i][0] for i in which], sp, use_tqdm=False, images=[prompts[i][1] for i in which])


def check(outs, prompts, refs, which=None) -> float:
    """Greedy tokens equal transformers'; returns the largest |logprob difference| (prompt and decode)."""
    worst = 0.0
    for i, out in zip(range(len(prompts)) if which is None else which, outs):
        ids, (ref_prompt, ref_tokens, ref_decode) = prompts[i][0], refs[i]
        assert out.outputs[0].token_ids == ref_tokens
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        dec = torch.tensor([out.outputs[0].logprobs[j][t] for j, t in enumerate(ref_tokens)])
        worst = max(worst, float((got - ref_prompt).abs().max()), float((dec - ref_decode).abs().max()))
    return worst
