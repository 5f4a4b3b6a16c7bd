"""Qwen3.5's MTP head (``ferry.executor.mtp``) against a torch reference written here from its
published structure (vLLM's qwen3_5_mtp): fc over concat(norm(embedding of token p + 1),
norm(target's hidden state at p)), transformers' own full-attention decoder layer, the head's norm
and the target's LM head; prefill in chunks and recursive drafting over its own KV. A tiny random
Qwen3.5 checkpoint with random ``mtp.*`` tensors of the published shapes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ferry.config import EngineConfig
from ferry.model.config import ModelConfig
from ferry.model.decoder import DecoderModel
from ferry.model.loader import load_safetensors
from tests.hybrid_models import Schedule
from tests.test_hybrid_qwen3_5 import make_model

PROMPT = [(7 * i + 3) % 300 + 2 for i in range(21)]


def _mtp_tensors(model) -> dict[str, torch.Tensor]:
    """Random mtp.* tensors: the full-attention layer's shapes, fc [hidden, 2 * hidden], (1 + w) norms."""
    g = torch.Generator().manual_seed(5)
    h = model.config.hidden_size
    full = model.config.layer_types.index("full_attention")
    out = {}
    for name, p in model.model.layers[full].state_dict().items():
        scale = 0.3 if "norm" in name else 0.08
        out[f"mtp.layers.0.{name}"] = torch.randn(p.shape, generator=g) * scale
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.08
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = torch.randn(h, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    model = make_model("dense", path)
    tensors = _mtp_tensors(model)
    save_file(tensors, str(path / "mtp.safetensors"))
    return path, model, tensors


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's (1 + w) RMS norm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class Reference:
    """The head as published, in torch: transformers' decoder layer for its one layer."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

        cfg = model.config
        self.model, self.t, self.eps = model, tensors, cfg.rms_norm_eps
        self.layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in tensors.items()
                                    if k.startswith("mtp.layers.0.")})

    @torch.inference_mode()
    def run(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row p: token ``tokens[p]`` (the one after position p) and ``hidden[p]``, at position p;
        every row's logits and normed hidden state."""
        n, t = len(tokens), self.t
        e = self.model.model.embed_tokens(torch.tensor([tokens]))
        x = torch.cat([_norm(e, t["mtp.pre_fc_norm_embedding.weight"], self.eps),
                       _norm(hidden[None], t["mtp.pre_fc_norm_hidden.weight"], self.eps)], -1) @ t["mtp.fc.weight"].T
        pos = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=self.model.model.rotary_emb(x, pos), attention_mask=mask)
        h = _norm(x, t["mtp.norm.weight"], self.eps)[0]
        return self.model.lm_head(h), h


def _target_hidden(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm


def _head(path, tensors=None):
    from ferry.executor.mtp import MTPHead

    cfg = ModelConfig.from_dir(path)
    target = DecoderModel(cfg, load_safetensors(path, skip=("mtp.",)), torch.float32, 256)
    if tensors is None:
        return MTPHead.load(path, cfg, target, torch.float32, 256, torch.device("cpu")), target, cfg
    return MTPHead(cfg, tensors, target, torch.float32, 256, torch.device("cpu")), target, cfg


def _caches(cfg, block: int):
    shape = (4 * block, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape))]


@pytest.mark.parametrize("chunks", [[20], [7, 13], [1, 19]])
def test_draft_logits_equal_the_published_structure(saved, chunks):
    path, model, tensors = saved
    head, _, cfg = _head(path)
    hidden = _target_hidden(model, PROMPT)
    ref_logits, _ = Reference(model, tensors).run(PROMPT[1:], hidden[:-1])
    sched = Schedule(steps=[[("p", 0, n)] for n in chunks], lengths=[20], slots=[1])
    caches = _caches(cfg, sched.block)
    ids, h = torch.tensor(PROMPT[1:]), hidden[:-1]
    got = sched.stepped(lambda rows, positions, meta: head.forward(ids[positions], h[positions], positions, meta,
                                                                   caches, torch.arange(len(positions)))[0],
                        [torch.arange(20)])[0]
    torch.testing.assert_close(got, ref_logits, rtol=1e-4, atol=1e-4)


def test_recursive_drafts_equal_the_reference(saved):
    """k = 3 drafts after the prompt, the head applied to its own hidden state and proposal each
    time, its KV kept over the decode steps: the same tokens and logits as the reference's full
    recomputation."""
    path, model, tensors = saved
    head, target, cfg = _head(path)
    hidden = _target_hidden(model, PROMPT)
    sched = Schedule(steps=[], lengths=[0], slots=[1])
    caches = _caches(cfg, sched.block)
    n = len(PROMPT) - 1
    rows, spans, dec = sched.batch([("p", 0, n)], [0])
    logits, h = head.forward(torch.tensor(PROMPT[1:]), hidden[:-1], torch.arange(n),
                             sched.metadata(rows, spans, dec), caches, torch.tensor([n - 1]))
    tokens, hid, drafts = list(PROMPT[1:]), list(hidden[:-1]), []
    ref = Reference(model, tensors)
    for j in range(3):
        want_logits, want_h = ref.run(tokens, torch.stack(hid))
        torch.testing.assert_close(logits[0], want_logits[-1], rtol=1e-4, atol=1e-4)
        d = int(logits[0].argmax())
        drafts.append(d)
        tokens.append(d)
        hid.append(want_h[-1])
        rows, spans, dec = sched.batch([("d", 0)], [n + j])
        logits, h = head.forward(torch.tensor([d]), h, torch.tensor([n + j]), sched.metadata(rows, spans, dec),
                                 caches, torch.tensor([0]))
    assert len(drafts) == 3


def test_the_target_hands_over_its_final_normed_hidden_states(saved):
    path, model, _ = saved
    _, target, cfg = _head(path)
    sched = Schedule(steps=[[("p", 0, len(PROMPT))]], lengths=[len(PROMPT)], slots=[1])
    kv = (4 * sched.block, cfg.num_kv_heads, cfg.head_dim)
    caches = [{k: torch.zeros(4, *s) for k, s in cfg.state_shapes(i).items()} if i in cfg.recurrent_layers
              else (torch.zeros(kv), torch.zeros(kv)) for i in range(cfg.num_layers)]
    rows, spans, dec = sched.batch(sched.steps[0], [0])
    out = target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), sched.metadata(rows, spans, dec), caches,
                         torch.arange(len(PROMPT)))
    torch.testing.assert_close(out.hidden, _target_hidden(model, PROMPT), rtol=1e-4, atol=1e-4)


def test_a_wrong_concat_order_is_caught(saved):
    """Not vacuous: the head with the two norms' inputs swapped gives other logits."""
    path, model, tensors = saved
    swapped = dict(tensors)
    h = model.config.hidden_size
    swapped["mtp.fc.weight"] = torch.cat([tensors["mtp.fc.weight"][:, h:], tensors["mtp.fc.weight"][:, :h]], 1)
    head, _, cfg = _head(path, swapped)
    hidden = _target_hidden(model, PROMPT)
    ref_logits, _ = Reference(model, tensors).run(PROMPT[1:], hidden[:-1])
    sched = Schedule(steps=[[("p", 0, 20)]], lengths=[20], slots=[1])
    rows, spans, dec = sched.batch(sched.steps[0], [0])
    got, _ = head.forward(torch.tensor(PROMPT[1:]), hidden[:-1], torch.arange(20), sched.metadata(rows, spans, dec),
                          _caches(cfg, 64), torch.arange(20))
    assert (got - ref_logits).abs().max() > 1e-2


def test_mtp_is_configured_as_vllm_spells_it():
    spec = EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2}).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"method": "mtp"}, tensor_parallel_size=2)


# ---------------------------------------------------------------- through the engine
E2E = [[(7 * i + 3 * n) % 300 + 2 for i in range(n)] for n in (3, 17, 40, 77)]
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
SETTINGS = {"batched": {}, "chunked": {"max_num_batched_tokens": 8},
            "preempted": {"num_kv_blocks": 30, "block_size": 4, "max_num_seqs": 4}}


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """The tiny Qwen3.5 with peaked logits (no near-ties between a verify's chunk and decode rows)
    and its random MTP head: (directory, model, mtp tensors)."""
    path = tmp_path_factory.mktemp("qwen3_5_mtp_peaked")
    model = make_model("dense")
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    tensors = _mtp_tensors(model)
    save_file(tensors, str(path / "mtp.safetensors"))
    return str(path), model, tensors


@pytest.fixture(scope="module")
def peaked(peaked_model):
    return peaked_model[0]


def _greedy(path: str, spec=None, **kw):
    from ferry import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", quant_activations="exact", speculative_config=spec, **kw)
    outs = llm.generate(E2E, SamplingParams(**GREEDY), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.fixture(scope="module")
def plain(peaked):
    return {name: _greedy(peaked, **kw)[0] for name, kw in SETTINGS.items()}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_are_the_targets_with_the_mtp_head(peaked, plain, setting, k):
    """k = 3 applies the one-layer head three times. Its random weights draft poorly: most verifies
    reject, so the recurrent state is put back and the tokens computed again."""
    got, llm = _greedy(peaked, {"method": "mtp", "num_speculative_tokens": k}, **SETTINGS[setting])
    assert got == plain[setting]
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    assert sum(s.num_draft_tokens for s in llm.engine.step_stats) == sched.num_draft_tokens
    if setting == "preempted":
        assert sched.num_preemptions > 0


def test_accepted_and_rejected_drafts_give_the_targets_tokens(peaked, plain, monkeypatch):
    """The head's drafts replaced by the right tokens (all of them for some requests, all but the
    last for others): whole and partial acceptance, the state kept or put back, the same output."""
    from ferry.executor.mtp import MTPProposer

    want = {tuple(p): out for p, out in zip(E2E, plain["batched"])}
    propose = MTPProposer.propose

    def oracle(self, out, states):
        dists = propose(self, out, states)
        for c in out.chunks:
            if c.spec_token_ids:
                r = states[c.request_id]
                done = c.start + 1 - len(r.prompt_token_ids)
                right = want[tuple(r.prompt_token_ids)][done:done + len(c.spec_token_ids)]
                right += [0] * (len(c.spec_token_ids) - len(right))
                if len(r.prompt_token_ids) % 2:  # odd prompts: the last draft is wrong
                    right[-1] = (right[-1] + 1) % 300
                c.spec_token_ids[:] = right
        return dists

    monkeypatch.setattr(MTPProposer, "propose", oracle)
    got, llm = _greedy(peaked, {"method": "mtp", "num_speculative_tokens": 3})
    assert got == plain["batched"]
    sched = llm.engine.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert llm.engine.step_stats[-1] is not None


def test_a_gemma4_assistant_drafter_is_refused_clearly(saved, tmp_path):
    """transformers' gemma4_assistant attends to the target's own K/V: no stand-alone draft model."""
    import json

    from ferry import LLM

    path, _, _ = saved
    for arch, kind in [("Gemma4AssistantForCausalLM", "gemma4_assistant"),
                       ("Gemma4UnifiedAssistantForCausalLM", "gemma4_unified_assistant")]:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": kind}))
        with pytest.raises(ValueError, match="Gemma 4 assistant drafter"):
            LLM(model=str(path), dtype="float32", speculative_config={"model": str(tmp_path)})


def _write_mtp_gguf(model, tensors: dict[str, torch.Tensor], path) -> None:
    """The head as llama.cpp's converter writes it with --mtp (conversion/qwen.py's _QwenMtpMixin,
    checked against its output): a qwen35 GGUF of block_count layers + 1 whose last block holds
    the head's layer, mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm as
    nextn.eh_proj / enorm / hnorm / shared_head_norm, every (1 + w) norm stored as 1 + w."""
    import gguf

    from tests.arch_models import add_tensor, finish, mapped_name

    n, arch = model.config.num_hidden_layers, gguf.MODEL_ARCH.QWEN35
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n + 1)
    w.add_nextn_predict_layers(1)
    names = gguf.get_tensor_name_map(arch, n + 1)
    nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head_norm"}
    for name, t in tensors.items():
        parts = name.split(".", 3)
        a = t.numpy() + (1.0 if name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_") else 0.0)
        if parts[1] == "layers":
            out = mapped_name(names, f"model.layers.{n}.{parts[3]}", "qwen35")
        else:  # (this gguf library's name map has no nextn names: llama.cpp's, as its converter writes them)
            out = f"blk.{n}.nextn.{nextn[parts[1]]}.{parts[2]}"
        add_tensor(w, out, a, "F32")
    finish(w, path)


def test_the_head_from_llama_cpps_mtp_gguf_drafts_for_a_gguf_target(peaked_model, tmp_path, monkeypatch):
    from ferry.executor.mtp import mtp_tensors_from_gguf
    from tests.gguf_qwen3_5 import write_gguf

    path, model, tensors = peaked_model
    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    _write_mtp_gguf(model, tensors, tmp_path / "mtp-head.gguf")
    got = mtp_tensors_from_gguf(tmp_path / "mtp-head.gguf", ModelConfig.from_dir(path))
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6)
    target = str(write_gguf(model, tmp_path / "target.gguf"))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": str(tmp_path / "mtp-head.gguf")}
    with_head, llm = _greedy(target, spec, quantization="none")
    assert with_head == _greedy(target, quantization="none")[0]
    assert llm.engine.scheduler.num_draft_tokens > 0
