"""A transformers LFM2 model's weights as a GGUF in llama.cpp's ``lfm2`` form (a test helper), as
its converter (conversion/lfm2.py) writes one: tensor names from the gguf library's own name map,
the conv weight squeezed to [hidden, K], KV heads per layer (0 on the short-conv layers), the MLP's
adjusted width as feed_forward_length, and ``lfm2.shortconv.l_cache``."""
from __future__ import annotations

from pathlib import Path

from ferry.model.arch.lfm2 import mlp_width
from tests.arch_models import add_sizes, add_tensor, finish, mapped_name


def write_gguf(model, path: Path, quantize: str = "F32") -> Path:
    """``model``'s weights (tied or not) as an ``lfm2`` GGUF; matrices float32, or quantized by the
    gguf library (``quantize="Q8_0"``) as llama.cpp quantizes them (norms and the conv stay float32)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "lfm2")
    add_sizes(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              [cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types], cfg.norm_eps,
              ff=mlp_width(cfg.to_dict()))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers)
    state = model.state_dict()
    if cfg.tie_word_embeddings:  # llama.cpp's file has no output tensor: it reads token_embd
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        a = t.float().numpy()
        if "conv.conv" in name and name.endswith("weight"):  # "conv op requires 2d tensor"
            a = a.squeeze(1)
        out = mapped_name(names, name, "lfm2")
        add_tensor(w, out, a, quantize, keep_float="shortconv.conv" in out)
    return finish(w, path)
