"""SmolLM3 (Hugging Face's small model, the successor of the embedded SmolLM2): the Llama layer with
no rotary embedding on every fourth layer (``no_rope_layers``: 1 rotates, 0 does not)."""
from typing import Any

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers

NO_ROPE = (0.0, {"rope_type": "none"})  # an identity rotation


def configure(d: dict[str, Any]) -> dict[str, Any]:
    from ferry.model.config import rope_scaling

    n = d["num_hidden_layers"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    full = (theta, rope_scaling(rope, "config.json"))
    interval = d.get("no_rope_layer_interval", 4)
    uses = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    kinds = d.get("layer_types") or ["full_attention"] * n
    return {"layers": llama_layers(d, ropes=[full if u else NO_ROPE for u in uses],
                                   windows=[window if k == "sliding_attention" else None for k in kinds],
                                   bias=bool(d.get("attention_bias", False)))}


# llama.cpp's smollm3: a llama (q/k rows interleaved) whose every 4th layer skips rope, in its code
# (``configure``'s default interval), not in the file.
ARCH = Architecture("SmolLM3ForCausalLM", "smollm3", gguf_name="smollm3", configure=configure,
                    gguf_permuted_qk=True)
