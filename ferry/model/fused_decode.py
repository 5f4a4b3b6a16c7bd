"""The decoder layers of a decode-only step as one C call (``kernels/decode_layers.c``).

With few requests a decode step does little arithmetic per operation, and in torch it pays ~25
operation dispatches per layer; the C path runs the same operations with none. A tensor-parallel
rank calls it twice per layer, for the attention and the MLP halves, and all-reduces each half's
partial output in between. Steps with a
prefill chunk, or more rows than ``FUSED_DECODE_ROWS``, go through torch, where each operation's
work is large enough to pay for its dispatch.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.attention import AttentionMetadata
from ferry.model.kv_format import KV_KINDS
from ferry.model.config import ModelConfig
from ferry.model.kernels import load_kernels
from ferry.model.quant import QuantWeight, RowStack

# Up to this many decodes the fused path wins (measured with --profile on the embedded model).
FUSED_DECODE_ROWS = 32
# The kernel's parts, in the order of its timing array.
PARTS = ("norm", "qkv", "rope", "attention", "o_proj", "gate_up", "act", "down")

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [(n, _p) for n in ("input_norm", "post_norm", "qkv_bias", "qkv", "o_proj", "gate_up", "down")] \
        + [(n, _i64) for n in ("qkv_type", "o_type", "gate_up_type", "down_type")] \
        + [("k_cache", _p), ("v_cache", _p), ("window", _i64)] \
        + [(n, _p) for n in ("q_norm", "k_norm", "cos", "sin", "attn_out_norm", "mlp_out_norm")] \
        + [("qkv_parts", _p), ("gate_up_parts", _p), ("n_qkv_parts", _i64), ("n_gate_up_parts", _i64)]


class _Part(ctypes.Structure):
    _fields_ = [("w", _p), ("type", _i64), ("rows", _i64)]


class _Dims(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "block_size")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("gelu", _i64), ("kv", _i64)]


def _ptr_type(w: Any) -> tuple[int, int]:
    if isinstance(w, RowStack):
        return 0, -1  # the parts say (_parts)
    return (w.data.data_ptr(), w.kernel_type) if isinstance(w, QuantWeight) else (w.data_ptr(), -1)


def _parts(w: Any) -> tuple[Any, int]:
    """A RowStack's parts as the C side reads them (None, 0 for one weight)."""
    if not isinstance(w, RowStack):
        return None, 0
    return (_Part * len(w.parts))(*[(p.data.data_ptr(), p.kernel_type, p.shape[0]) for p in w.parts]), len(w.parts)


class FusedDecode:
    """Holds the layers' pointers for the C call; ``run`` updates the residual stream in place."""

    def __init__(self, cfg: ModelConfig, layers: list[Any], scale: float,
                 ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 heads: tuple[int, int] | None = None, comm: Any = None) -> None:
        """``heads``: this rank's (query, KV) heads, and its slice of the MLP is its weights' (tensor
        parallelism, with ``comm`` its collectives); the whole model's by default."""
        self.cfg = cfg
        self.layers = layers  # keeps the weights alive while the C side points at them
        self.ropes = ropes or []  # per-layer rope tables (layer.rope indexes them), kept alive too
        self.comm = comm
        hq, hkv = heads or (cfg.num_heads, cfg.num_kv_heads)
        inter = layers[0].gate_up.shape[0] // 2 if layers and layers[0].gate_up is not None else cfg.intermediate_size
        self.dims = _Dims(cfg.hidden_size, hq, hkv, cfg.head_dim, inter, 0, cfg.rms_norm_eps, scale,
                          int(cfg.hidden_act == "gelu_tanh"), 0)
        self._table: Any = None
        self._caches: Any = None
        self.times = (ctypes.c_double * len(PARTS))()

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if self._caches is not kv_caches:  # the executor's caches live as long as it does
            table = (_Layer * len(self.layers))()
            self._keep: list[Any] = []  # the parts' arrays, alive while the table points at them
            for t, layer, (k, v) in zip(table, self.layers, kv_caches):
                t.input_norm, t.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
                t.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
                t.qkv, t.qkv_type = _ptr_type(layer.qkv)
                qkv_parts, t.n_qkv_parts = _parts(layer.qkv)
                gate_up_parts, t.n_gate_up_parts = _parts(layer.gate_up)
                t.qkv_parts = None if qkv_parts is None else ctypes.addressof(qkv_parts)
                t.gate_up_parts = None if gate_up_parts is None else ctypes.addressof(gate_up_parts)
                self._keep += [qkv_parts, gate_up_parts]
                t.o_proj, t.o_type = _ptr_type(layer.o_proj)
                t.gate_up, t.gate_up_type = _ptr_type(layer.gate_up)
                t.down, t.down_type = _ptr_type(layer.down)
                t.k_cache, t.v_cache = k.data_ptr(), v.data_ptr()
                t.window = layer.window or 0
                t.q_norm = None if layer.q_norm is None else layer.q_norm.data_ptr()
                t.k_norm = None if layer.k_norm is None else layer.k_norm.data_ptr()
                t.attn_out_norm = None if layer.attn_out_norm is None else layer.attn_out_norm.data_ptr()
                t.mlp_out_norm = None if layer.mlp_out_norm is None else layer.mlp_out_norm.data_ptr()
                if self.ropes:
                    t.cos, t.sin = (r.data_ptr() for r in self.ropes[layer.rope])
            self._table, self._caches = table, kv_caches
        return self._table

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor,
            profiler: Any = None) -> None:
        """x: [B, hidden] float32 contiguous, one decode per row; changed in place."""
        table = self._layer_table(kv_caches)
        self.dims.block_size = meta.block_size
        self.dims.kv = KV_KINDS[kv_caches[0][0].dtype]
        tables = meta.decode_block_tables
        for i in range(len(PARTS)):
            self.times[i] = 0.0
        args = (ctypes.byref(self.dims), x.data_ptr(), x.shape[0], positions.data_ptr(), cos.data_ptr(),
                sin.data_ptr(), tables.data_ptr(), tables.shape[1], meta.decode_lens.data_ptr(),
                meta.slot_mapping.data_ptr(), self.times)
        lib = load_kernels()
        if self.comm is None:
            lib.decode_layers(table, len(self.layers), *args, -1, None)
        else:
            out, size = torch.empty_like(x), ctypes.sizeof(_Layer)
            for i, layer in enumerate(self.layers):
                one = ctypes.addressof(table) + i * size
                for part, out_norm in ((0, layer.attn_out_norm), (1, layer.mlp_out_norm)):
                    lib.decode_layers(one, 1, *args, part, out.data_ptr())
                    self.comm.all_reduce(out)
                    x += out if out_norm is None else F.rms_norm(out, (out.shape[-1],), out_norm, self.cfg.rms_norm_eps)
        if profiler is not None:
            profiler.split(dict(zip(PARTS, self.times)), "layers")
