"""Idefics3 and SmolVLM: a Llama language model (its fields in text_config, its tensors under
model.text_model.) whose ``<image>`` tokens take the rows of a SigLIP tower and a pixel-shuffle
connector (``ferry.model.layers.idefics3``; tensors under model.vision_model. and model.connector.).

An image becomes tiles of the tower's square size plus a global (whole image) tile, each of
``image_seq_len`` rows; the prompt marks them with ``<fake_token_around_image>``, ``<row_i_col_j>``
and ``<global-img>`` (``ferry.multimodal.idefics3``). Positions are ordinary 1-D rope. Pure Python.
"""
from __future__ import annotations

from ferry.model.arch import Architecture
from ferry.model.arch.parts import NAMES

_TEXT = {"embed": ("model.text_model.embed_tokens", "token_embd"),
         "final_norm": ("model.text_model.norm", "output_norm")}
_TOWER = ("model.vision_model.", "model.connector.")

IDEFICS3_ARCH = Architecture("Idefics3ForConditionalGeneration", "idefics3", names={**NAMES, **_TEXT},
                             layer_prefix="model.text_model.layers", text_config=True, skip_prefixes=_TOWER)
SMOLVLM_ARCH = Architecture("SmolVLMForConditionalGeneration", "smolvlm", names={**NAMES, **_TEXT},
                            layer_prefix="model.text_model.layers", text_config=True, skip_prefixes=_TOWER)

# The checkpoints whose images run through ``ferry.model.layers.idefics3``.
IDEFICS3_ARCHITECTURES = (IDEFICS3_ARCH.hf_name, SMOLVLM_ARCH.hf_name)
