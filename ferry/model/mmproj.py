"""A vision tower from llama.cpp's ``--mmproj`` GGUF (what ``convert_hf_to_gguf.py --mmproj`` writes
beside a text GGUF): one :class:`ProjectorTable` per projector type (``clip.projector_type``) turns
its tensors into the Hugging Face checkpoint's names and its metadata into config.json's
``vision_config`` and the image processor's rules (preprocessor_config.json's fields), so the
family's tower (``ferry.model.layers.vision``) and image prompter run as for a checkpoint directory.

Adding a family is one table: ``register_projector(ProjectorTable(...))``. The mmproj tensors are
dequantized to float32 (the tower runs torch's products). ``find_mmproj`` finds the file beside a
text GGUF where llama.cpp's naming (``mmproj-*.gguf``) leaves one candidate.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

Meta = Callable[..., Any]  # meta(key, default=None): a metadata field of the mmproj


@dataclass(frozen=True)
class ProjectorTable:
    """How one projector type's mmproj reads as a checkpoint's vision tower.

    ``names``: llama.cpp's tensor name without its ``.weight``/``.bias`` suffix (``{i}``: a block or
    layer number) -> the checkpoint's name under ``prefix`` (``{i}`` the same number). ``finish``
    reshapes what the names alone cannot say (split or renumbered tensors), given the vision config.
    """

    projector_type: str  # clip.projector_type (or clip.vision.projector_type)
    architectures: tuple[str, ...]  # config.json architectures whose tower this is
    prefix: str  # where the tower's tensors live in the checkpoint ("model.visual.")
    names: dict[str, str]
    vision_config: Callable[[Meta, dict[str, np.ndarray]], dict[str, Any]]  # config.json's vision_config
    preprocessor: Callable[[Meta], dict[str, Any]]  # preprocessor_config.json (its image_processor_type too)
    finish: Callable[[dict[str, np.ndarray], dict[str, Any]], dict[str, np.ndarray]] = lambda t, vc: t
    config: Callable[[Meta], dict[str, Any]] = field(default=lambda meta: {})  # other config.json fields
    # The architectures of the text GGUFs llama.cpp writes beside this tower where they are not the
    # image model's own (Gemma 3's text is "gemma3", SmolVLM's "llama"): the pair runs as ``architectures[0]``.
    text_architectures: tuple[str, ...] = ()

    def image_architecture(self, text_architecture: str) -> str | None:
        """The image model a text GGUF of ``text_architecture`` forms with this tower (None: no pair)."""
        if text_architecture in self.architectures:
            return text_architecture
        return self.architectures[0] if text_architecture in self.text_architectures else None


PROJECTORS: dict[str, ProjectorTable] = {}


def register_projector(table: ProjectorTable) -> ProjectorTable:
    """Add a projector type's table (its type must be new)."""
    if table.projector_type in PROJECTORS:
        raise ValueError(f"projector type {table.projector_type!r} is already registered")
    PROJECTORS[table.projector_type] = table
    return table


@dataclass
class Mmproj:
    """An mmproj read as a checkpoint's tower: its table, vision config, image processor rules and
    float32 tensors under the checkpoint's names (prefix included)."""

    path: Path
    table: ProjectorTable
    vision_config: dict[str, Any]
    preprocessor: dict[str, Any]
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]


def _patterns(names: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    out = []
    for gguf_name, hf in names.items():
        regex = re.escape(gguf_name).replace(r"\{i\}", r"(?P<i>\d+)")
        out.append((re.compile(regex + r"\.(?P<suffix>(weight|bias)(\.\d+)?)$"), hf))
    return out


def hf_tensor_name(name: str, table: ProjectorTable) -> str:
    """The checkpoint name (without the prefix) of an mmproj tensor; a ValueError for an unknown one."""
    for regex, hf in _patterns(table.names):
        m = regex.match(name)
        if m:
            base = hf.replace("{i}", m.group("i")) if m.groupdict().get("i") is not None else hf
            return f"{base}.{m.group('suffix')}"
    raise ValueError(f"unknown tensor {name!r} for projector type {table.projector_type!r}")


def _meta_reader(reader) -> Meta:
    fields = {k: f.contents() for k, f in reader.fields.items()}

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    return meta


def projector_type(reader) -> str | None:
    """The vision projector type an mmproj declares (None: not an mmproj)."""
    meta = _meta_reader(reader)
    return meta("clip.vision.projector_type") or meta("clip.projector_type")


def read_mmproj(path: Path | str) -> Mmproj:
    """An mmproj GGUF as a vision tower: ValueError naming the file for a projector type without a table."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"mmproj file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf-py's words alone ("GGUF magic invalid") name neither the file nor its role
        raise ValueError(f"mmproj {str(path)!r} is not a GGUF file ({e})") from e
    kind = projector_type(reader)
    if kind is None:
        arch = _meta_reader(reader)("general.architecture")
        what = f"a text model's GGUF (architecture {arch!r})" if arch else "a GGUF without a vision tower"
        raise ValueError(f"mmproj {str(path)!r} is {what}, not an mmproj GGUF (no clip.projector_type); give the "
                         f"vision tower's file that convert_hf_to_gguf.py --mmproj writes (mmproj-*.gguf)")
    if kind not in PROJECTORS:
        raise ValueError(f"mmproj {str(path)!r}: unsupported projector type {kind!r}; "
                         f"ferry reads {', '.join(PROJECTORS)}")
    table = PROJECTORS[kind]
    meta = _meta_reader(reader)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # a copy: writable
        tensors[hf_tensor_name(t.name, table)] = data
    vision_config = table.vision_config(meta, tensors)
    tensors = table.finish(tensors, vision_config)
    return Mmproj(path, table, vision_config, table.preprocessor(meta), table.config(meta),
                  {table.prefix + k: v for k, v in tensors.items()})


def tower_source(model_dir: Path, mmproj: "Mmproj | None", projector_type: str, family: str,
                 only: tuple[str, ...]) -> "tuple[dict[str, Any], dict[str, Any]] | None":
    """An image model's config and vision-tower tensors (torch): from ``mmproj`` where given (it must be
    of ``projector_type``; ``family`` names the model in the error), else the checkpoint directory's
    tensors under ``only``; None for a directory without a vision_config (its text runs alone)."""
    import json

    import torch

    from ferry.model.loader import load_safetensors

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if mmproj is not None:
        if mmproj.table.projector_type != projector_type:
            raise ValueError(f"mmproj {str(mmproj.path)!r} (projector type {mmproj.table.projector_type!r}) "
                             f"is not a {family} tower")
        config = {**config, **mmproj.config, "vision_config": mmproj.vision_config}
        return config, {k: torch.from_numpy(v) for k, v in mmproj.tensors.items()}
    if "vision_config" not in config:
        return None
    return config, load_safetensors(Path(model_dir), only=only)


def is_mmproj(path: Path) -> bool:
    """Whether a GGUF file is an mmproj (a vision projector), by its metadata."""
    from gguf import GGUFReader

    try:
        return projector_type(GGUFReader(str(path))) is not None
    except Exception:  # not a GGUF at all: not an mmproj either
        return False


def find_mmproj(gguf_path: Path) -> Path | None:
    """The mmproj beside a text GGUF when llama.cpp's naming makes it unambiguous: the one
    ``mmproj-*.gguf`` in its directory (several: the one whose name holds the text file's stem)."""
    gguf_path = Path(gguf_path)
    if gguf_path.name.lower().startswith("mmproj"):
        return None
    named = sorted(p for p in gguf_path.parent.glob("*.gguf") if p.name.lower().startswith("mmproj"))
    found = [p for p in named if is_mmproj(p)]
    for p in set(named) - set(found):  # a name alone does not make a tower: the metadata must
        log.warning("ignoring %s beside %s: not an mmproj GGUF (no clip.projector_type)", p, gguf_path)
    if len(found) > 1:
        stem = gguf_path.stem.lower()
        found = [p for p in found if p.stem.lower().removeprefix("mmproj-").split("-")[0] in stem]
    if len(found) != 1:
        if found:
            log.warning("several mmproj files beside %s: pass --mmproj to choose one", gguf_path)
        return None
    return found[0]


# ---- Qwen3-VL (``qwen3vl_merger``): convert_hf_to_gguf.py's Qwen3VLVisionModel ----

_QWEN3VL_NAMES = {
    "v.patch_embd": "patch_embed.proj", "v.position_embd": "pos_embed",
    "v.blk.{i}.ln1": "blocks.{i}.norm1", "v.blk.{i}.ln2": "blocks.{i}.norm2",
    "v.blk.{i}.attn_qkv": "blocks.{i}.attn.qkv", "v.blk.{i}.attn_out": "blocks.{i}.attn.proj",
    "v.blk.{i}.ffn_up": "blocks.{i}.mlp.linear_fc1", "v.blk.{i}.ffn_down": "blocks.{i}.mlp.linear_fc2",
    "v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2",
    # Deepstack mergers are numbered by their vision block here; ``_qwen3vl_finish`` renumbers them.
    "v.deepstack.{i}.norm": "deepstack.{i}.norm", "v.deepstack.{i}.fc1": "deepstack.{i}.linear_fc1",
    "v.deepstack.{i}.fc2": "deepstack.{i}.linear_fc2",
}


def _qwen3vl_vision_config(meta: Meta, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    deep = meta("clip.vision.is_deepstack_layers") or []
    return {
        "depth": meta("clip.vision.block_count"), "hidden_size": meta("clip.vision.embedding_length"),
        "intermediate_size": meta("clip.vision.feed_forward_length"),
        "num_heads": meta("clip.vision.attention.head_count"), "out_hidden_size": meta("clip.vision.projection_dim"),
        "patch_size": meta("clip.vision.patch_size"), "spatial_merge_size": meta("clip.vision.spatial_merge_size", 2),
        "temporal_patch_size": 2,  # llama.cpp splits the Conv3d's two frames (it writes no other)
        "num_position_embeddings": int(tensors["pos_embed.weight"].shape[0]),
        "deepstack_visual_indexes": [i for i, d in enumerate(deep) if d],
        "hidden_act": "gelu_pytorch_tanh" if meta("clip.use_gelu", True) else "silu",
    }


def _decimal(values: list[float]) -> list[float]:
    """float32 metadata back to the decimals written (0.4, not 0.4000000059604645): the processor's own."""
    return [float(f"{v:.7g}") for v in values]


def _qwen3vl_preprocessor(meta: Meta) -> dict[str, Any]:
    patch, merge = meta("clip.vision.patch_size"), meta("clip.vision.spatial_merge_size", 2)
    token_pixels = (patch * merge) ** 2
    # llama.cpp's limits when the file names none (clip.cpp: 8 to 4096 image tokens).
    lo = meta("clip.vision.image_min_pixels") or 8 * token_pixels
    hi = meta("clip.vision.image_max_pixels") or 4096 * token_pixels
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "merge_size": merge,
            "temporal_patch_size": 2, "image_mean": _decimal(meta("clip.vision.image_mean")),
            "image_std": _decimal(meta("clip.vision.image_std")), "do_resize": True,
            "size": {"shortest_edge": int(lo), "longest_edge": int(hi)}}


def _qwen3vl_finish(tensors: dict[str, np.ndarray], vc: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    layers = vc["deepstack_visual_indexes"]
    for name, a in tensors.items():
        if name.startswith("deepstack."):  # block number -> position among the deepstack blocks
            _, block, rest = name.split(".", 2)
            out[f"deepstack_merger_list.{layers.index(int(block))}.{rest}"] = a
        elif name == "patch_embed.proj.weight.1":
            continue
        elif name == "patch_embed.proj.weight":  # the Conv3d's frames, split in two Conv2d kernels
            out[name] = np.stack([a, tensors["patch_embed.proj.weight.1"]], axis=2)
        else:
            out[name] = a
    return out


QWEN3VL = register_projector(ProjectorTable(
    "qwen3vl_merger", ("Qwen3VLForConditionalGeneration",), "model.visual.", _QWEN3VL_NAMES,
    _qwen3vl_vision_config, _qwen3vl_preprocessor, _qwen3vl_finish))


# ---- Idefics3 / SmolVLM (``idefics3``): convert_hf_to_gguf.py's SmolVLMModel ----

def _siglip_names(tower: str) -> dict[str, str]:
    """llama.cpp's names of a SigLIP tower's tensors (``v.*``) and the checkpoint's under ``tower``."""
    layer = tower + "encoder.layers.{i}."
    return {"v.patch_embd": tower + "embeddings.patch_embedding", "v.position_embd": tower + "embeddings.position_embedding",
            "v.blk.{i}.ln1": layer + "layer_norm1", "v.blk.{i}.ln2": layer + "layer_norm2",
            "v.blk.{i}.attn_q": layer + "self_attn.q_proj", "v.blk.{i}.attn_k": layer + "self_attn.k_proj",
            "v.blk.{i}.attn_v": layer + "self_attn.v_proj", "v.blk.{i}.attn_out": layer + "self_attn.out_proj",
            "v.blk.{i}.ffn_up": layer + "mlp.fc1", "v.blk.{i}.ffn_down": layer + "mlp.fc2",
            "v.post_ln": tower + "post_layernorm"}


_IDEFICS3_NAMES = {**_siglip_names("vision_model."), "mm.model.fc": "connector.modality_projection.proj"}


def _siglip_vision_config(meta: Meta, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """A SigLIP tower's vision_config from an mmproj's metadata (Idefics3 / SmolVLM, Gemma 3)."""
    return {
        "hidden_size": meta("clip.vision.embedding_length"), "intermediate_size": meta("clip.vision.feed_forward_length"),
        "num_hidden_layers": meta("clip.vision.block_count"), "num_attention_heads": meta("clip.vision.attention.head_count"),
        "image_size": meta("clip.vision.image_size"), "patch_size": meta("clip.vision.patch_size"),
        "layer_norm_eps": _decimal([meta("clip.vision.attention.layer_norm_epsilon", 1e-6)])[0],
        "hidden_act": "gelu_pytorch_tanh" if meta("clip.use_gelu", True) else "silu",
    }


def _idefics3_preprocessor(meta: Meta) -> dict[str, Any]:
    # The tile is the tower's square (llama.cpp keeps no other); the longest edge, the processor's own.
    tile = int(meta("clip.vision.image_size"))
    return {"image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True, "do_resize": True,
            "max_image_size": {"longest_edge": tile},
            "size": {"longest_edge": int(meta("clip.vision.preproc_image_size") or 4 * tile)},
            "image_mean": _decimal(meta("clip.vision.image_mean")), "image_std": _decimal(meta("clip.vision.image_std"))}


IDEFICS3 = register_projector(ProjectorTable(
    "idefics3", ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"), "model.",
    _IDEFICS3_NAMES,
    _siglip_vision_config, _idefics3_preprocessor,
    config=lambda meta: {"scale_factor": int(meta("clip.vision.projector.scale_factor", 2))},
    text_architectures=("LlamaForCausalLM",)))


# ---- Gemma 3 (``gemma3``): convert_hf_to_gguf.py's Gemma3VisionModel ----

_GEMMA3_TOWER = "vision_tower.vision_model."
_GEMMA3_NAMES = {**_siglip_names(_GEMMA3_TOWER), "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
                 "mm.input_projection": "multi_modal_projector.mm_input_projection"}


def _gemma3_config(meta: Meta) -> dict[str, Any]:
    # The projector pools the patch grid by scale_factor (4 unless the file says otherwise, clip.cpp's rule).
    side = int(meta("clip.vision.image_size")) // int(meta("clip.vision.patch_size"))
    return {"mm_tokens_per_image": (side // int(meta("clip.vision.projector.scale_factor", 4))) ** 2}


def _gemma3_preprocessor(meta: Meta) -> dict[str, Any]:
    size = int(meta("clip.vision.image_size"))
    return {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
            "do_pan_and_scan": False, "image_mean": _decimal(meta("clip.vision.image_mean")),
            "image_std": _decimal(meta("clip.vision.image_std"))}


def _gemma3_finish(tensors: dict[str, np.ndarray], vc: dict[str, Any]) -> dict[str, np.ndarray]:
    out = dict(tensors)
    # The projection is a bare parameter in the checkpoint (no ".weight"); llama.cpp's converter
    # stored the soft-embedding norm as 1 + w (Gemma3RMSNorm's scale), the checkpoint keeps w.
    projection = out.pop("multi_modal_projector.mm_input_projection.weight")
    out["multi_modal_projector.mm_input_projection_weight"] = projection
    out["multi_modal_projector.mm_soft_emb_norm.weight"] = out["multi_modal_projector.mm_soft_emb_norm.weight"] - 1.0
    return out


GEMMA3 = register_projector(ProjectorTable(
    "gemma3", ("Gemma3ForConditionalGeneration",), "", _GEMMA3_NAMES, _siglip_vision_config, _gemma3_preprocessor,
    _gemma3_finish, config=_gemma3_config, text_architectures=("Gemma3ForCausalLM",)))
