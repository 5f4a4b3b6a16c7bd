"""GGUF-quantized weights kept quantized in memory (every type in QUANT_TYPES), and products with them.

``load_gguf_weights`` reads a llama GGUF straight into Hugging Face names: float tensors as
float32, quantized ones in the file's own blocks, for the C kernels (``kernels/quant_types.h``). ``quant_linear`` multiplies float32 activations with a quantized weight: the kernel for
few rows, and for many rows the weight dequantized in slices into one reused buffer, then BLAS.
Either way the result is the float32 model's (the dequantization is the gguf library's, bit for
bit), up to the order of the sums.
"""
from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from pathlib import Path

import numpy as np
import torch

from ferry.model.kernels import Q8_ISA_MACROS, QtTraits, load_kernels


@dataclass(frozen=True)
class QuantType:
    """One GGUF type ferry keeps quantized: its blocks as the file stores them (float16 scales),
    served by the C kernels under ``kernel_id`` (the GGML type id). The fields are the row of
    ``kernels/quant_types.h`` (``ferry_qt_traits_t`` in ``kernels/ferry_kernels.h``), in order."""

    name: str
    kernel_id: int
    block: int  # weights per block: 32, or a K-quant's super-block of 256
    nbytes: int  # bytes per block
    group: int  # weights per scale group of the q8 products: 16 or 32
    offset: bool  # w = a q + b: a float16 min (m, dmin) 2 bytes after d
    shift: int  # levels stored unsigned as the level plus this (0: stored as they are)
    d_at: int  # byte offset of the block's float16 scale d

    @property
    def k_quant(self) -> bool:
        """Super-blocks of 256 weights (Q2_K..Q6_K, IQ4_XS)."""
        return self.block == 256

    @property
    def float16_fields(self) -> tuple[int, int]:
        """The byte range of the block's float16 scales: d, and an offset type's min after it (empty
        for an E8M0 scale)."""
        if self.name in E8M0_TYPES:
            return self.d_at, self.d_at
        return self.d_at, self.d_at + 2 + 2 * self.offset


# Mirrors kernels/quant_types.h row for row (the kernels are optional, the table is not);
# ``check_kernel_types`` compares the two at load.
QUANT_TYPES = {t.name: t for t in (
    QuantType("Q4_0", 2, 32, 18, 32, False, 8, 0), QuantType("Q4_1", 3, 32, 20, 32, True, 0, 0),
    QuantType("Q5_0", 6, 32, 22, 32, False, 16, 0), QuantType("Q5_1", 7, 32, 24, 32, True, 0, 0),
    QuantType("Q8_0", 8, 32, 34, 32, False, 0, 0), QuantType("Q2_K", 10, 256, 84, 16, True, 0, 80),
    QuantType("Q3_K", 11, 256, 110, 16, False, 4, 108), QuantType("Q4_K", 12, 256, 144, 32, True, 0, 0),
    QuantType("Q5_K", 13, 256, 176, 32, True, 0, 0), QuantType("Q6_K", 14, 256, 210, 16, False, 32, 208),
    QuantType("IQ4_NL", 20, 32, 18, 32, False, 0, 0), QuantType("IQ4_XS", 23, 256, 136, 32, False, 0, 0),
    QuantType("MXFP4", 39, 32, 17, 32, False, 0, 0),
)}
# Types whose block scale is one E8M0 byte at d_at (a power of two), not a float16.
E8M0_TYPES = ("MXFP4",)
FLOAT_TYPES = ("F32", "F16", "BF16")
ACTIVATION_MODES = ("exact", "q8")
Q8_FLAG = 256  # kernels/quant_types.h's FERRY_QT_Q8
PACKED_FLAG = 512  # its FERRY_QT_PACKED
# quant_q8_isa's variant ids (kernels/quant_q8.h), in order.
Q8_ISAS = tuple(name for name, _ in Q8_ISA_MACROS)

# Exact mode: up to this many rows the kernel's product wins; above it, dequantize-then-BLAS
# (measured with `ferry bench kernels`: BLAS's packing pays off once the weight is reused by many
# rows). q8 mode takes its integer kernels at every M.
KERNEL_ROWS = 32
# Weights are dequantized for BLAS in slices of at most this many floats (16 MiB), so the buffer
# stays small whatever the matrix (the LM head has 28M weights).
SLICE_FLOATS = 4 * 2**20


def check_kernel_types(lib) -> None:
    """Raise RuntimeError when the compiled table (quant_types.h) differs from QUANT_TYPES, naming
    the rows that differ."""
    row = QtTraits()
    rows = []
    for i in range(lib.quant_type_traits(0, ctypes.byref(row))):
        lib.quant_type_traits(i, ctypes.byref(row))
        rows.append((row.name.decode(), row.id, row.block, row.bytes, row.group, bool(row.offset), row.shift, row.d_at))
    ours = [(t.name, t.kernel_id, t.block, t.nbytes, t.group, t.offset, t.shift, t.d_at) for t in QUANT_TYPES.values()]
    if rows != ours:
        differ = [f"{a} vs. {b}" for a, b in zip(rows, ours) if a != b] or [f"{len(rows)} rows vs. {len(ours)}"]
        raise RuntimeError(f"kernels/quant_types.h differs from quant.QUANT_TYPES (library vs. Python): {'; '.join(differ)}")


def _kernels():
    lib = load_kernels()
    if lib is not None and not getattr(lib, "types_checked", False):
        check_kernel_types(lib)
        lib.types_checked = True
    return lib


@dataclass
class QuantWeight:
    """A [N, K] weight kept in the file's blocks (``data``: uint8 [N, K / block * bytes per block])."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    # "exact": float32 activations (the dequantized model's results); "q8": activations quantized
    # per block of 32 to int8 and integer dot products at every number of rows (quant_q8.c; packed
    # weights' in quant_q8_packed.c, the file layout's by the portable reference products), each
    # row's result the same bits whatever the batch.
    activations: str = "exact"
    # True: ``data`` is ``pack_rows16``'s layout (q8 products only), not the file's.
    packed: bool = False

    @property
    def kind(self) -> QuantType:
        return QUANT_TYPES[self.qtype]

    @property
    def kernel_type(self) -> int:
        """The product kernel's type id (the fused decode passes it on): the type, plus the q8 and
        packed flags."""
        if self.packed and self.activations != "q8":
            raise ValueError(f"a {self.qtype} weight packed by 16 rows multiplies in q8 mode only")
        return self.kind.kernel_id | (Q8_FLAG if self.activations == "q8" else 0) | (PACKED_FLAG if self.packed else 0)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class RowStack:
    """Quantized weights of different types stacked along the output dimension (a Q4_K_M file's
    fused qkv: Q5_0 q and k beside a Q8_0 v), each kept in its own blocks; a product runs part by
    part into its columns of the output."""

    parts: list[QuantWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def qtype(self) -> str:
        """The parts' types in order, e.g. ``Q5_0+Q8_0``."""
        return "+".join(p.qtype for p in self.parts)


def repack(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """A [N, K] tensor's GGUF blocks (bytes, row-major) as a QuantWeight, kept as they are."""
    t = QUANT_TYPES[qtype]
    n, k = shape
    if k % t.block:
        raise ValueError(f"a {qtype} row of {k} weights is not whole blocks of {t.block}")
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // t.block * t.nbytes)
    return QuantWeight(torch.from_numpy(data.copy()), qtype, shape)


@lru_cache(maxsize=None)
def _record_index(qtype: str) -> np.ndarray | None:
    """[16, block bytes]: where byte j of row n's block sits in its packed record, from the layout
    table of kernels/quant_q8_packed.c (its one definition); None for a type it does not pack."""
    t = QUANT_TYPES[qtype]
    idx = np.empty((16, t.nbytes), dtype=np.int64)
    return idx if _kernels().q8_packed_index(t.kernel_id, idx.ctypes.data) == 0 else None


def packable(qtype: str) -> bool:
    """True when q8 products read ``qtype`` packed by 16 rows."""
    return _record_index(qtype) is not None


def pack_rows16(w: QuantWeight) -> QuantWeight:
    """A q8 weight of a ``packable`` type packed for kernels/quant_q8_packed.c: per group of 16 rows
    and block, one record whose vector lanes are the rows (the last group padded with zero rows).
    The same bytes permuted, so the same size and the same products, bit for bit."""
    if w.packed or not packable(w.qtype):
        raise ValueError(f"only unpacked weights of the packable types pack by 16 rows, not {w.qtype}"
                         f"{' (packed already)' if w.packed else ''}")
    (n, k), b = w.shape, w.kind.nbytes
    nc, g = k // w.kind.block, -(-n // 16)
    blocks = np.zeros((g * 16, nc, b), dtype=np.uint8)
    blocks[:n] = w.data.numpy().reshape(n, nc, b)
    records = np.zeros((g, nc, 16 * b), dtype=np.uint8)
    records[:, :, _record_index(w.qtype).ravel()] = blocks.reshape(g, 16, nc, b).transpose(0, 2, 1, 3).reshape(g, nc, -1)
    return QuantWeight(torch.from_numpy(records.reshape(g * 16, nc * b)), w.qtype, w.shape, w.activations, packed=True)


def unpack_rows16(w: QuantWeight, rows: torch.Tensor | None = None) -> QuantWeight:
    """Rows of a packed weight (all, or those in ``rows``) in the file's blocks again."""
    (n, k), b = w.shape, w.kind.nbytes
    nc = k // w.kind.block
    r = np.arange(n) if rows is None else rows.to(torch.int64).numpy()
    records = w.data.numpy().reshape(-1, nc, 16 * b)
    blocks = records[(r // 16)[:, None, None], np.arange(nc)[None, :, None], _record_index(w.qtype)[r % 16][:, None, :]]
    return QuantWeight(torch.from_numpy(blocks.reshape(len(r), nc * b)), w.qtype, (len(r), k), w.activations)


def packed(w: torch.Tensor | QuantWeight | RowStack) -> torch.Tensor | QuantWeight | RowStack:
    """``w`` as q8 products read it fastest: q8 weights of ``packable`` types (and such parts of a
    RowStack) packed by 16 rows, anything else as it is."""
    if isinstance(w, RowStack):
        return RowStack([packed(p) for p in w.parts])
    if isinstance(w, QuantWeight) and w.activations == "q8" and not w.packed and packable(w.qtype):
        return pack_rows16(w)
    return w


def dequantize(w: QuantWeight | RowStack, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows of ``w`` (all of them, or those in ``rows``: embedding lookups)."""
    if isinstance(w, RowStack):
        whole = torch.cat([dequantize(p) for p in w.parts])
        return whole if rows is None else whole[rows.to(torch.int64)]
    if w.packed:  # just the rows asked for (embedding lookups of a packed tied LM head)
        w, rows = unpack_rows16(w, rows), None
    n = w.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, w.shape[1], dtype=torch.float32)
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    _kernels().quant_dequant(w.data.data_ptr(), None if ids is None else ids.data_ptr(),
                                 out.data_ptr(), n, w.shape[1], w.kind.kernel_id)
    return out


def quant_linear(x: torch.Tensor, w: QuantWeight | RowStack) -> torch.Tensor:
    """x [M, K] float32 @ dequant(w).T -> [M, N]: q8 weights through the integer kernels at any M
    (faster than dequantize-then-BLAS there too, measured), exact ones as the module says."""
    if isinstance(w, RowStack):
        return torch.cat([quant_linear(x, p) for p in w.parts], dim=1)
    x = x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    lib = _kernels()
    kernel_type = w.kernel_type  # a ValueError for a packed weight outside q8 mode
    if m <= KERNEL_ROWS or w.activations == "q8":
        y = torch.empty(m, n, dtype=torch.float32)
        lib.quant_gemm(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), m, n, k, kernel_type)
        return y
    step = max(1, SLICE_FLOATS // k)
    buf = torch.empty(min(n, step), k, dtype=torch.float32)
    if n <= step:
        lib.quant_dequant(w.data.data_ptr(), None, buf.data_ptr(), n, k, w.kind.kernel_id)
        return torch.mm(x, buf.t())
    # A large matrix (an LM head) in row slices of y.T: each slice of the weight is dequantized
    # and used at once, while in cache.
    yt = torch.empty(n, m, dtype=torch.float32)
    row_bytes = w.data.shape[1]
    for n0 in range(0, n, step):
        rows = min(step, n - n0)
        lib.quant_dequant(w.data.data_ptr() + n0 * row_bytes, None, buf.data_ptr(), rows, k, w.kind.kernel_id)
        torch.mm(buf[:rows], x.t(), out=yt[n0:n0 + rows])
    return yt.t().contiguous()


def set_activations(weights: dict, mode: str) -> None:
    """Run every quantized weight of ``weights`` in activation mode ``mode`` (ACTIVATION_MODES)."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"quant_activations must be one of {ACTIVATION_MODES}, got {mode!r}")
    for w in weights.values():
        if isinstance(w, QuantWeight):
            w.activations = mode


def uses_q8(weights: dict) -> bool:
    """Whether any quantized weight of ``weights`` runs with int8 activations (the KV cache then
    defaults to float16)."""
    return any(isinstance(w, QuantWeight) and w.activations == "q8" for w in weights.values())


def q8_isa(name: str | None = None) -> str:
    """The q8 kernels' instruction-set variant in use; ``name`` (one of Q8_ISAS) switches to it,
    a ValueError when this CPU lacks it."""
    lib = _kernels()
    got = lib.quant_q8_isa(-2 if name is None else Q8_ISAS.index(name))
    if got < 0:
        raise ValueError(f"this CPU cannot run the {name} q8 kernels")
    return Q8_ISAS[got]


def cat_rows(ws: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight | RowStack:
    """Stack weights along the output dimension (fused qkv, gate+up): one QuantWeight where they
    share a type, a RowStack of runs of one type where quantized types differ (kept in their blocks:
    a float32 copy would be 5-8x their size), float32 when some are float."""
    if any(isinstance(w, QuantWeight) and w.packed for w in ws):
        raise ValueError("weights packed by 16 rows cannot be stacked: stack them before packing")
    if all(isinstance(w, QuantWeight) for w in ws):
        runs = [list(run) for _, run in groupby(ws, key=lambda w: w.kernel_type)]
        parts = [QuantWeight(torch.cat([w.data for w in run]).contiguous(), run[0].qtype,
                             (sum(w.shape[0] for w in run), run[0].shape[1]), run[0].activations) for run in runs]
        return parts[0] if len(parts) == 1 else RowStack(parts)
    return torch.cat([dequantize(w) if isinstance(w, QuantWeight) else w for w in ws]).contiguous()


# v2: the file's own blocks (v1 held float32-scale repacks).
CACHE_FILE = "ferry-quantized-v2.safetensors"


def cached_gguf_weights(path: Path, cache_dir: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """``load_gguf_weights``, saved once in ``cache_dir`` (the converted model's directory):
    parsing a GGUF's metadata takes seconds (the whole vocabulary), loading the saved tensors
    a fraction of one."""
    from safetensors.torch import load_file, save_file

    cached = cache_dir / CACHE_FILE
    if cached.is_file():
        from safetensors import safe_open

        with safe_open(str(cached), "pt") as f:
            kinds = json.loads(f.metadata()["ferry"])
        # Copied out of the file's mapping, which lives while any tensor of it does: a norm weight
        # would keep the whole file resident beside the packed copies q8 mode makes (+1x the model).
        tensors = {name: t.clone() for name, t in load_file(str(cached)).items()}
        return {name: QuantWeight(tensors[name], kinds[name][0], tuple(kinds[name][1])) if name in kinds
                else tensors[name] for name in tensors}
    weights = load_gguf_weights(path)
    kinds = {n: (w.qtype, w.shape) for n, w in weights.items() if isinstance(w, QuantWeight)}
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    save_file({n: w.data if isinstance(w, QuantWeight) else w for n, w in weights.items()}, str(tmp),
              metadata={"ferry": json.dumps(kinds)})
    tmp.replace(cached)
    return weights


def load_gguf_weights(path: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of a GGUF under its Hugging Face name; quantized ones stay quantized.

    Raises ValueError naming the tensor and its type when a type is neither a float nor one the
    kernels keep quantized (serve such a file with ``quantization="none"``, which dequantizes it all).
    """
    from gguf import GGUFReader

    from ferry.model.gguf_convert import hf_tensors

    reader = GGUFReader(str(path))
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in FLOAT_TYPES and (qtype not in QUANT_TYPES or int(t.shape[0]) % QUANT_TYPES[qtype].block):
            raise ValueError(f"{path.name}: tensor {t.name!r} has GGUF type {qtype}, which ferry cannot keep "
                             f"quantized (supported: {', '.join(QUANT_TYPES)}); use --quantization none")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, qtype, shape, data in hf_tensors(reader, keep=tuple(QUANT_TYPES)):
        # A float tensor may be the file's own (read-only) pages: copied, as the weights outlive the reader.
        out[name] = repack(data, qtype, shape) if qtype in QUANT_TYPES else torch.from_numpy(data.copy())
    return out
