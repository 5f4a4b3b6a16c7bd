"""Small C kernels (paged decode and prefill attention, skinny GEMM, quantized GEMM), loaded with ctypes.

Where they run: x86-64 (the q8 products pick their AVX2, AVX-512, VNNI or AMX variant from the CPU
at run time), built with gcc. Elsewhere (another machine type, no C compiler, a compiler that is not
gcc, a torch without libgomp) or with FERRY_NO_KERNELS=1, ``load_kernels()`` logs one line naming
why and returns None, and callers run the portable torch path (tests/test_kernels_boundary.py runs
the model both ways).

They are built once with the system C compiler. No torch headers are needed, so the build takes
seconds; the shared library is cached under ~/.cache/ferry/kernels keyed by source, flags and CPU
(any change to a kernel source is a new key, so the first load after it compiles again). OpenMP
comes from the libgomp that torch itself loads, so the kernels and torch share one thread pool
instead of two pools fighting over the cores.

The boundary: kernels/ferry_kernels.h declares every function and struct Python uses, and the
library exports it as tables; SIGNATURES and STRUCTS below are its ctypes side, compared with those
tables at load (``check_abi``), so a mismatch is a RuntimeError, not a call with wrong arguments.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

from ferry.model.gguf_convert import default_cache_dir

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in ("paged_attention.c", "prefill_attention.c", "skinny_gemm.c", "quant_gemm.c", "decode_layers.c", "recurrent_decode.c",
                                                 "quant_dequant.c", "quant_q8.c", "quant_q8_packed.c", "row_ops.c", "int8_peak.c",
                                                 "recurrent_prefill.c", "ferry_abi.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("ferry_kernels.h", "vec.h", "vmath.h", "f32_rows.h", "quant_types.h", "kv_types.h", "quant_q8.h",
                                                 "row_ops.h", "decode_ops.h")]
# The machine types the kernels are written for (platform.machine()'s names of x86-64).
MACHINES = ("x86_64", "AMD64")
# FERRY_KERNEL_ARCH picks the target (e.g. "haswell": AVX2+FMA, no AVX-512), to build and measure
# what most users' CPUs run on a machine that has more.
ARCH = f"-march={os.environ.get('FERRY_KERNEL_ARCH', 'native')}"
COMPILE_FLAGS = ["-O3", ARCH, "-ffast-math", "-fPIC", "-fopenmp"]
# The attention kernels mask scores with -INFINITY and take exp(-inf) as 0: fast math, without its
# promise that no value is infinite or NaN (which would let the compiler drop what masking needs).
INFINITY_FLAGS = [*COMPILE_FLAGS, "-fno-finite-math-only"]
INFINITY_SOURCES = ("paged_attention.c", "prefill_attention.c")
# Dequantization must be the gguf library's float32 arithmetic bit for bit: no fast math, no fused
# multiply-adds.
# The q8 kernels: a baseline x86-64 build whose variants each enable their own instructions
# (target attributes), so the AVX2 one runs on AVX2-only CPUs; one float order for all variants.
EXACT_FLAGS = {"quant_dequant.c": ["-O3", ARCH, "-fno-fast-math", "-ffp-contract=off", "-fPIC"],
               "quant_q8.c": ["-O3", "-march=x86-64-v2", "-mtune=native", "-fno-fast-math", "-ffp-contract=off",
                              "-fPIC", "-fopenmp"]}
EXACT_FLAGS["quant_q8_packed.c"] = EXACT_FLAGS["quant_q8.c"]


def source_flags(name: str) -> list[str]:
    """The compiler flags kernel source ``name`` (a file name of SOURCES) is built with."""
    if name in EXACT_FLAGS:
        return EXACT_FLAGS[name]
    return INFINITY_FLAGS if name in INFINITY_SOURCES else COMPILE_FLAGS


i64, i32, f32, f64, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double, ctypes.c_void_p


class QtTraits(ctypes.Structure):
    """ferry_kernels.h's ferry_qt_traits_t: one quantized type's row of kernels/quant_types.h."""

    _fields_ = [("name", ctypes.c_char * 8), ("id", i64), ("block", i64), ("bytes", i64), ("group", i64),
                ("offset", i64), ("shift", i64), ("d_at", i64)]


class WeightPart(ctypes.Structure):
    """decode_ops.h's wpart_t: one run of rows of one type in a stack of weights (quant.RowStack)."""

    _fields_ = [("w", ptr), ("type", i64), ("rows", i64)]


class DecodeOp(ctypes.Structure):
    """decode_ops.h's decode_op_t: one op of the fused decode's list (ferry.model.fused_decode)."""

    _fields_ = [(n, i64) for n in ("code", "src", "dst", "part")] + [("w", ptr), ("w2", ptr), ("type", i64),
                                                                     ("parts", ptr)] \
        + [(n, i64) for n in ("n_parts", "n", "k")] + [("scale", f32)] \
        + [(n, ptr) for n in ("k_cache", "v_cache", "cos", "sin", "w3", "w4", "shape")]


# decode_ops.h's DECODE_BUFFERS: the row buffers the ops read and write.
DECODE_BUFFERS = 11


class DecodeDims(ctypes.Structure):
    """decode_ops.h's decode_dims_t: what every op of a fused decode reads."""

    _fields_ = [(n, i64) for n in ("n_heads", "n_kv_heads", "head_dim", "block_size", "kv")] \
        + [("eps", f32), ("width", i64 * DECODE_BUFFERS), ("state_slots", ptr)]


# ferry_kernels.h's structs (FERRY_KERNEL_STRUCTS): their ctypes mirrors by C name.
STRUCTS: dict[str, type[ctypes.Structure]] = {"ferry_qt_traits_t": QtTraits, "decode_op_t": DecodeOp,
                                              "decode_dims_t": DecodeDims, "wpart_t": WeightPart}
# ferry_kernels.h's functions (FERRY_KERNEL_FUNCTIONS), in its order: (restype, argtypes).
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "paged_decode_attention": (None, [ptr] * 6 + [i64] * 6 + [f32, i64, i64, ptr]),
    "kv_store": (None, [ptr, ptr, i64, i64]),
    "paged_prefill_attention": (i32, [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, f32, i64, i64, ptr]),
    "skinny_gemm": (None, [ptr, ptr, ptr, i64, i64, i64]),
    "quant_gemm": (None, [ptr, ptr, ptr, i64, i64, i64, i64]),
    "quant_dequant": (None, [ptr, ptr, ptr, i64, i64, i64]),
    "quant_q8_isa": (i64, [i64]),
    "int8_peak": (f64, [i64, i64]),
    "read_bandwidth": (f64, [i64, i64]),
    "q8_packed_index": (i64, [i64, ptr]),
    "quant_type_traits": (i64, [i64, ctypes.POINTER(QtTraits)]),
    "rms_norm_rows": (None, [ptr, i64, ptr, ptr, i64, i64, f32]),
    "rope_rows": (None, [ptr, i64, i64, i64, ptr, ptr, ptr, i64]),
    "gated_act_rows": (None, [ptr, ptr, i64, i64, i64]),
    "conv_rows": (None, [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]),
    "gdn_prefill": (i32, [ptr] * 9),
    "decode_ops": (i32, [ctypes.POINTER(DecodeOp), i64, ctypes.POINTER(DecodeDims), ptr, ptr, i64, ptr, ptr, i64,
                         ptr, ptr, ptr]),
    "decode_counts": (None, [ptr]),
    "ferry_abi_function": (i64, [i64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]),
    "ferry_abi_struct": (i64, [i64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(i64)]),
}
# ferry_abi.c's kind letters of ctypes' types (pointers of every kind are "p").
_KINDS = {i64: "i", i32: "I", f32: "f", f64: "d"}


def _kind(t: Any) -> str:
    if t is None:
        return "v"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "p"
    return _KINDS[t]


def signature(restype: Any, argtypes: list[Any]) -> str:
    """A ctypes signature as ferry_abi_function spells it: "v:ppi" (return kind, then each argument's)."""
    return _kind(restype) + ":" + "".join(_kind(t) for t in argtypes)


def _library_table(lib: ctypes.CDLL, fn: str, value: Any) -> dict[str, Any]:
    """Every row of one of the library's boundary tables (ferry_abi_function or ferry_abi_struct)."""
    name, rows = ctypes.c_char_p(), {}
    get = getattr(lib, fn)
    for i in range(get(0, ctypes.byref(name), ctypes.byref(value))):
        get(i, ctypes.byref(name), ctypes.byref(value))
        rows[name.value.decode()] = value.value.decode() if isinstance(value.value, bytes) else value.value
    return rows


def check_abi(lib: ctypes.CDLL, signatures: dict[str, tuple[Any, list[Any]]] = SIGNATURES,
              structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> None:
    """Raise RuntimeError where ``lib``'s boundary (ferry_kernels.h) differs from ``signatures`` and
    ``structs``: a function on one side only, another signature (argument count or kinds, return
    kind), a struct on one side only or of another size."""
    if not hasattr(lib, "ferry_abi_function"):
        raise RuntimeError(f"{lib._name} has no boundary table (ferry_abi.c): not ferry's kernel library")
    theirs = _library_table(lib, "ferry_abi_function", ctypes.c_char_p())
    ours = {name: signature(*sig) for name, sig in signatures.items()}
    problems = [f"{n}: library {theirs.get(n, 'absent')}, Python {ours.get(n, 'absent')}"
                for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]
    sizes = _library_table(lib, "ferry_abi_struct", ctypes.c_int64())
    mirrors = {name: ctypes.sizeof(cls) for name, cls in structs.items()}
    problems += [f"sizeof({n}): library {sizes.get(n, 'absent')}, Python {mirrors.get(n, 'absent')}"
                 for n in sorted(set(sizes) | set(mirrors)) if sizes.get(n) != mirrors.get(n)]
    if problems:
        raise RuntimeError("the kernel library's boundary (kernels/ferry_kernels.h) differs from its ctypes "
                           "table (SIGNATURES, STRUCTS in kernels/__init__.py): " + "; ".join(problems) +
                           " (kinds: v void, p pointer, i int64_t, I int, f float, d double)")


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[Any, list[Any]]] = SIGNATURES) -> None:
    """Each function's restype and argtypes from the table (check_abi reports any it lacks)."""
    for name, (restype, argtypes) in signatures.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes


def _torch_libgomp() -> Path | None:
    import torch

    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_id() -> str:
    try:
        return next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        return platform.processor()


class _Off(Exception):
    """Why the kernels do not run here (load_kernels logs it once at ``level``)."""

    def __init__(self, why: str, level: int = logging.WARNING):
        super().__init__(why)
        self.level = level


def _not_gcc(cc: str) -> str | None:
    """Why ``cc`` cannot build the kernels (they use gcc's vector extensions), or None for gcc."""
    r = subprocess.run([cc, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    if r.returncode != 0:
        return f"the C compiler {cc} does not run ({r.stderr.strip()[:200]})"
    if "__GNUC__" not in r.stdout or "__clang__" in r.stdout:
        return f"the kernels need gcc and {cc} is another compiler"
    return None


@lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library; None, after one log line naming why, where the kernels do not
    run (module docstring). Raises RuntimeError when the library's boundary differs from ours."""
    try:
        return _load()
    except _Off as off:
        log.log(off.level, "C kernels off: %s; the portable torch path runs", off)
        return None


def _load() -> ctypes.CDLL:
    if os.environ.get("FERRY_NO_KERNELS"):
        raise _Off("FERRY_NO_KERNELS is set", logging.INFO)
    machine = platform.machine()
    if machine not in MACHINES:
        raise _Off(f"they are x86-64 code and this machine is {machine or 'of an unknown type'}")
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        raise _Off(f"no C compiler ({cc})")
    gomp = _torch_libgomp()
    if gomp is None:
        raise _Off("torch ships no libgomp here")
    link = [f"-Wl,-rpath,{gomp.parent}", str(gomp), "-lm"]
    text = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    flags = " ".join(COMPILE_FLAGS + link + [f for src in SOURCES for f in [src.name, *source_flags(src.name)]])
    key = hashlib.sha256(text + flags.encode() + _cpu_id().encode()).hexdigest()[:16]
    lib = default_cache_dir() / "kernels" / f"ferry-kernels-{key}.so"
    if not lib.is_file():
        _build(cc, link, lib)
    so = ctypes.CDLL(str(lib))
    _declare(so)
    check_abi(so)
    if "FERRY_KERNEL_ARCH" in os.environ:
        so.quant_q8_isa(_arch_q8_isa(cc))
    return so


def _build(cc: str, link: list[str], lib: Path) -> None:
    """Compile SOURCES into the shared library ``lib`` (atomically: another process may build it too)."""
    why = _not_gcc(cc)
    if why:
        raise _Off(why)
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".tmp{os.getpid()}.so")
    try:
        # -fopenmp compiles the pragmas; linking torch's libgomp by path (not -lgomp) keeps one runtime.
        objs = [tmp.with_suffix(f".{src.stem}.o") for src in SOURCES]
        for src, obj in zip(SOURCES, objs):
            subprocess.run([cc, *source_flags(src.name), "-c", str(src), "-o", str(obj)], check=True,
                           capture_output=True, text=True)
        subprocess.run([cc, "-shared", *map(str, objs), "-o", str(tmp), *link], check=True,
                       capture_output=True, text=True)
        for obj in objs:
            obj.unlink()
    except (subprocess.CalledProcessError, OSError) as e:
        raise _Off(f"could not build them ({getattr(e, 'stderr', None) or e})") from None
    tmp.replace(lib)


# The q8 kernels' variants (kernels/quant_q8.h's ISA ids, in order) and the macro each needs.
Q8_ISA_MACROS = (("portable", ""), ("avx2", "__AVX2__"), ("avx512bw", "__AVX512BW__"), ("avxvnni", "__AVXVNNI__"),
                 ("avx512vnni", "__AVX512VNNI__"), ("amx", "__AMX_INT8__"))


def _arch_q8_isa(cc: str) -> int:
    """The best q8 variant FERRY_KERNEL_ARCH's target has: the q8 kernels pick theirs from the CPU
    at run time, so without this an AVX2-only build would still run AVX-512 q8 products here."""
    macros = subprocess.run([cc, ARCH, "-dM", "-E", "-"], input="", capture_output=True, text=True).stdout
    # avxvnni (256-bit VNNI) ranks below avx512vnni and above avx512bw, as quant_q8_isa's own order.
    for name in ("amx", "avx512vnni", "avxvnni", "avx512bw", "avx2"):
        if dict(Q8_ISA_MACROS)[name] in macros:
            return [n for n, _ in Q8_ISA_MACROS].index(name)
    return 0


def kernels_usable(dtype) -> bool:
    """True when the kernels can serve a model of ``dtype`` (they are float32 only)."""
    import torch

    return dtype == torch.float32 and load_kernels() is not None
