"""Mixture of experts: ferry routes tokens to the experts transformers chooses, and its per-expert
batched products equal transformers' block when experts get no token, one, or many."""
from __future__ import annotations

import torch

from ferry.model.layers.experts import RoutedExperts, route
from tests.arch_models import make_model


def _ferry_layer(block, top_k: int, renorm: bool) -> RoutedExperts:
    ex = block.experts
    return RoutedExperts(block.gate.weight.detach(), ex.gate_up_proj.detach(), ex.down_proj.detach(), top_k, renorm)


def test_routing_chooses_the_experts_transformers_chooses(tmp_path):
    model = make_model("qwen3-moe", tmp_path)
    block = model.model.layers[0].mlp
    h = torch.randn(200, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_chosen = block.gate(h)
    weights, chosen = route(h, block.gate.weight.detach(), model.config.num_experts_per_tok, True)
    assert torch.equal(chosen, hf_chosen)
    torch.testing.assert_close(weights, hf_weights.float())
    assert len(set(chosen.flatten().tolist())) == model.config.num_experts  # every expert chosen somewhere


def test_experts_with_no_token_one_token_and_many_match_transformers(tmp_path):
    model = make_model("qwen3-moe", tmp_path)
    block = model.model.layers[0].mlp
    n_exp, hidden = model.config.num_experts, model.config.hidden_size
    # A router that sends token t to experts by its first coordinates: tokens 1.. to experts 0 and 2
    # (many), token 0 to experts 5 and 2; experts 1, 3, 4, 6, 7 get none.
    router = torch.zeros(n_exp, hidden)
    router[0, 0], router[2, 1], router[5, 2] = 10.0, 5.0, 20.0
    h = torch.randn(9, hidden, generator=torch.Generator().manual_seed(2)) * 0.1
    h[:, 0], h[:, 1], h[:, 2] = 1.0, 1.0, 0.0
    h[0, 0], h[0, 2] = 0.0, 1.0
    with torch.no_grad():
        block.gate.weight.copy_(router)
        ref = block(h[None])[0]
    layer = _ferry_layer(block, 2, True)
    _, chosen = route(h, layer.router, 2, True)
    counts = torch.bincount(chosen.flatten(), minlength=n_exp).tolist()
    assert counts[5] == 1 and counts[0] == 8 and counts[2] == 9 and counts.count(0) == 5
    with torch.no_grad():
        got = layer.forward(h)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_experts_split_over_two_ranks_match_one_process(tmp_path):
    """Tensor parallelism slices every expert's MLP like a dense one (router replicated, one
    all-reduce after the experts): the same prompt logprobs and greedy tokens as transformers."""
    from ferry import LLM, SamplingParams
    from tests.arch_models import hf_greedy, hf_logprobs

    model = make_model("qwen3-moe", tmp_path)
    prompt = [(7 * i + 3) % 300 + 2 for i in range(30)]
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=8, prompt_logprobs=0),
                           use_tqdm=False)[0]
    finally:
        llm.close()
    got = torch.tensor([out.prompt_logprobs[j][prompt[j]] for j in range(1, len(prompt))])
    assert float((got - hf_logprobs(model, prompt)).abs().max()) < 2e-4
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
