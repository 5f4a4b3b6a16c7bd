"""The decoder layers of a decode-only step as one C call (``kernels/decode_layers.c``), running a
list of ops that the layers' parts compile (``ops`` on each part of ``ferry.model.layers``).

With few requests a decode step does little arithmetic per operation, and in torch it pays ~25
operation dispatches per layer; the C path runs the same operations with none. A part the C side
has no op for (Nemotron-H's sigmoid-routed experts) makes ``compile_ops`` give up, and the model decodes through torch.
A tensor-parallel rank runs the list in segments, one per residual add, and all-reduces each
segment's partial output in between. Steps with a prefill chunk, or more rows than
``FUSED_DECODE_ROWS``, go through torch, where each operation's work is large enough to pay for
its dispatch.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ferry.model.attention import AttentionMetadata
from ferry.model.kernels import DecodeDims, DecodeOp, WeightPart, load_kernels
from ferry.model.kv_format import KV_KINDS
from ferry.model.quant import QuantWeight, RowStack

# Up to this many decodes the fused path wins (measured with --profile on the embedded model).
FUSED_DECODE_ROWS = 32
# The profiler's parts, in the order of the timing array (an op names the one its time goes to).
PARTS = ("norm", "qkv", "rope", "attention", "o_proj", "gate_up", "act", "down", "in_proj", "recurrent", "out_proj",
         "experts")

# kernels/decode_ops.h's op codes and buffers, in order.
OPS = ("norm", "matmul", "bias", "rope_kv", "attention", "gated_act", "add", "gdn", "short_conv", "gate", "mamba2", "relu2",
       "experts", "heads_rope_kv", "heads_attention", "gated_act_n", "act_mul", "scale")
BUFFERS = ("x", "out", "h", "qkv", "q", "attn", "gu", "act", "tmp", "rin", "rout")  # rin, rout: a recurrent part's

class NotFused(Exception):
    """A part has no op in the C decode: the model decodes through torch."""


@dataclass
class Op:
    """One op of the list: names for codes, buffers and the profiler's part; tensors for pointers."""

    code: str
    src: str
    dst: str
    part: str
    w: Any = None  # a norm's scale, a bias, or a product's weight (tensor, QuantWeight, RowStack)
    w2: torch.Tensor | None = None
    n: int = 0
    k: int = 0
    scale: float = 0.0
    cache: tuple[torch.Tensor, torch.Tensor] | None = None  # K and V, or a recurrent op's two state tensors
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    width: int = 0  # the row width of what it writes to dst (0: dst's width is set elsewhere)
    w3: torch.Tensor | None = None  # a recurrent op's further weights
    w4: torch.Tensor | None = None
    shape: tuple[int, ...] = ()  # a recurrent op's sizes
    experts: Sequence[Any] = ()  # an experts op's products: each expert's gate_up, then each one's down
    # Its rows in dst are ``width`` floats one after another, however wide the buffer (ops of a
    # layer's own sizes: Gemma 4's head sizes and double-wide MLPs); the buffer is its widest.
    packed: bool = False


@dataclass
class Segment:
    """Ops up to one residual add; under tensor parallelism the add is the caller's, after its
    all-reduce of ``out`` (normed by ``out_norm`` where the part has one)."""

    ops: list[Op]
    out_norm: torch.Tensor | None = None
    scale: float = 1.0  # the output's scale before the residual add
    post: list[Op] = field(default_factory=list)  # after the residual add, on one rank (Gemma 4's layer scalar)


@dataclass
class Program:
    """The C structs of a compiled op list, and everything they point at, kept alive."""

    segments: list[tuple[Any, int, torch.Tensor | None]]  # (op array, op count, out_norm)
    widths: dict[str, int]
    keep: list[Any] = field(default_factory=list)


def check_codes(lib: Any) -> None:
    """Raise RuntimeError when kernels/decode_ops.h's ops or buffers differ in number from OPS and
    BUFFERS (its structs' sizes are load_kernels' check)."""
    got = (ctypes.c_int64 * 2)()
    lib.decode_counts(got)
    if list(got) != [len(OPS), len(BUFFERS)]:
        raise RuntimeError(f"kernels/decode_ops.h has {got[0]} ops and {got[1]} buffers; fused_decode.py names "
                           f"{len(OPS)} and {len(BUFFERS)}")


def _weight(w: Any, keep: list[Any]) -> tuple[int | None, int, int | None, int]:
    """(pointer, type, parts array, parts) of a product's weight."""
    if isinstance(w, RowStack):
        parts = (WeightPart * len(w.parts))(*[(p.data.data_ptr(), p.kernel_type, p.shape[0]) for p in w.parts])
        keep.append(parts)
        return None, -1, ctypes.addressof(parts), len(w.parts)
    if isinstance(w, QuantWeight):
        return w.data.data_ptr(), w.kernel_type, None, 0
    return w.data_ptr(), -1, None, 0


def _expert_parts(ws: Sequence[Any], keep: list[Any]) -> int:
    """The address of a WeightPart array of ``ws`` (each one QuantWeight or float32 tensor)."""
    parts = (WeightPart * len(ws))(*[(w.data.data_ptr(), w.kernel_type, w.shape[0]) if isinstance(w, QuantWeight)
                                     else (w.data_ptr(), -1, w.shape[0]) for w in ws])
    keep.append(parts)
    return ctypes.addressof(parts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _op_struct(op: Op, keep: list[Any]) -> DecodeOp:
    s = DecodeOp(OPS.index(op.code), BUFFERS.index(op.src), BUFFERS.index(op.dst), PARTS.index(op.part))
    if op.code == "matmul":
        s.w, s.type, s.parts, s.n_parts = _weight(op.w, keep)
    elif op.experts:
        s.w, s.type, s.parts, s.n_parts = _ptr(op.w), -1, _expert_parts(op.experts, keep), len(op.experts)
    else:
        s.w, s.type = _ptr(op.w), -1
    s.w2, s.n, s.k, s.scale = _ptr(op.w2), op.n, op.k, op.scale
    if op.cache is not None:
        s.k_cache, s.v_cache = op.cache[0].data_ptr(), op.cache[1].data_ptr()
    if op.rope is not None:
        s.cos, s.sin = op.rope[0].data_ptr(), op.rope[1].data_ptr()
    s.w3, s.w4 = _ptr(op.w3), _ptr(op.w4)
    if op.shape:
        shape = (ctypes.c_int64 * len(op.shape))(*op.shape)
        keep.append(shape)
        s.shape = ctypes.addressof(shape)
    return s


def _widths(segments: Sequence[Segment], hidden: int) -> dict[str, int]:
    """Each buffer's row width: what its ops write there, the same wherever it is written."""
    widths = {"x": hidden, "out": hidden, "h": hidden, "tmp": hidden}
    for seg in segments:
        for op in seg.ops:
            if op.width and op.packed:
                widths[op.dst] = max(widths.get(op.dst, 0), op.width)
            elif op.width and widths.setdefault(op.dst, op.width) != op.width:
                raise ValueError(f"buffer {op.dst!r} written {widths[op.dst]} and {op.width} floats wide")
    return widths


class FusedDecode:
    """A model's compiled op list for the C call; ``run`` updates the residual stream in place."""

    def __init__(self, compile_segments: Any, hidden: int, heads: tuple[int, int, int], eps: float,
                 comm: Any = None) -> None:
        """``compile_segments(kv_caches)``: the model's op list in segments (``Segment``), raising
        NotFused where a part has no op; ``heads``: this rank's (query heads, KV heads, head size)."""
        self.compile_segments = compile_segments
        self.hidden, self.eps, self.comm = hidden, eps, comm
        self.dims = DecodeDims(*heads, 0, 0, eps)
        self._program: Program | None = None
        self._caches: Any = None
        self.times = (ctypes.c_double * len(PARTS))()
        check_codes(load_kernels())

    def _compiled(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Program:
        if self._caches is not kv_caches:  # the executor's caches live as long as it does
            segments = self.compile_segments(kv_caches)
            if self.comm is None:  # one call for the whole model: each segment ends with its residual add
                segments = [Segment([op for s in segments for op in s.ops + _residual_add(s) + s.post])]
            keep: list[Any] = []
            compiled = []
            for seg in segments:
                ops = (DecodeOp * len(seg.ops))(*[_op_struct(op, keep) for op in seg.ops])
                compiled.append((ops, len(seg.ops), seg.out_norm))
            self._program = Program(compiled, _widths(segments, self.hidden), keep + [segments])
            self._caches = kv_caches
            for i, name in enumerate(BUFFERS):
                self.dims.width[i] = self._program.widths.get(name, 0)
        return self._program

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], profiler: Any = None) -> None:
        """x: [B, hidden] float32 contiguous, one decode per row; changed in place."""
        program = self._compiled(kv_caches)
        self.dims.block_size = meta.block_size
        self.dims.kv = KV_KINDS[next(c for c in kv_caches if isinstance(c, tuple))[0].dtype] \
            if any(isinstance(c, tuple) for c in kv_caches) else 0
        slots = meta.decode_state_slots
        self.dims.state_slots = None if slots is None else slots.data_ptr()
        tables = meta.decode_block_tables
        for i in range(len(PARTS)):
            self.times[i] = 0.0
        out = x if self.comm is None else torch.empty_like(x)
        lib = load_kernels()
        for ops, n, out_norm in program.segments:
            status = lib.decode_ops(ops, n, ctypes.byref(self.dims), x.data_ptr(), out.data_ptr(), x.shape[0],
                                    positions.data_ptr(), tables.data_ptr(), tables.shape[1],
                                    meta.decode_lens.data_ptr(), meta.slot_mapping.data_ptr(), self.times)
            if status:
                raise MemoryError("the fused decode could not allocate its buffers") if status == 1 else \
                    RuntimeError(f"the fused decode met an op it lacks (status {status})")
            if self.comm is not None:
                self.comm.all_reduce(out)
                x += out if out_norm is None else F.rms_norm(out, (out.shape[-1],), out_norm, self.eps)
        if profiler is not None:
            profiler.split(dict(zip(PARTS, self.times)), "layers")


def _residual_add(seg: Segment) -> list[Op]:
    """The add that ends a segment on one rank: its last ops wrote "out" (a product, then its bias
    where it has one); here they write "tmp", which joins x (normed first where the part says)."""
    for op in seg.ops:  # on one rank "out" is x itself
        op.src, op.dst = ("tmp" if op.src == "out" else op.src), ("tmp" if op.dst == "out" else op.dst)
    return [Op("add", "tmp", "x", seg.ops[-1].part, w=seg.out_norm, scale=seg.scale)]
