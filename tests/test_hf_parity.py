"""ferry's greedy tokens equal Hugging Face transformers' greedy generate, token for token."""
from __future__ import annotations

import pytest
import torch

from ferry import SamplingParams

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_greedy(embedded_dir, parity_prompts):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in parity_prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def test_greedy_matches_transformers(llm, parity_prompts, hf_greedy):
    assert sorted(len(p) for p in parity_prompts) == [5, 17, 42, 90, 150, 230, 310, 400]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(parity_prompts, sp, use_tqdm=False)
    for prompt, out, ref in zip(parity_prompts, outs, hf_greedy):
        assert len(ref) == NEW_TOKENS
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverges"
