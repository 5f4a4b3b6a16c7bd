"""Small C kernels (paged decode and prefill attention, skinny GEMM, quantized GEMM), loaded with ctypes.

They are built once with the system C compiler. No torch headers are needed, so
the build takes a few seconds; the shared library is cached under ~/.cache/ferry/kernels keyed by source, flags and CPU.
OpenMP comes from the libgomp that torch itself loads, so the kernels and torch
share one thread pool instead of two pools fighting over the cores. Without a
compiler (or without that libgomp) callers fall back to the pure-torch path.
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

from ferry.model.gguf_convert import default_cache_dir

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in ("paged_attention.c", "prefill_attention.c", "skinny_gemm.c", "quant_gemm.c", "decode_layers.c",
                                                 "quant_dequant.c", "quant_q8.c", "quant_q8_tiles.c", "quant_q8_packed.c", "row_ops.c", "int8_peak.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("vec.h", "vmath.h", "f32_rows.h", "quant_types.h", "kv_types.h", "quant_q8.h", "q8_levels.h", "row_ops.h")]
# FERRY_KERNEL_ARCH picks the target (e.g. "haswell": AVX2+FMA, no AVX-512), to build and measure
# what most users' CPUs run on a machine that has more.
ARCH = f"-march={os.environ.get('FERRY_KERNEL_ARCH', 'native')}"
COMPILE_FLAGS = ["-O3", ARCH, "-ffast-math", "-fPIC", "-fopenmp"]
# Dequantization must be the gguf library's float32 arithmetic bit for bit: no fast math, no fused
# multiply-adds.
# The q8 kernels: a baseline x86-64 build whose variants each enable their own instructions
# (target attributes), so the AVX2 one runs on AVX2-only CPUs; one float order for all variants.
EXACT_FLAGS = {"quant_dequant.c": ["-O3", ARCH, "-fno-fast-math", "-ffp-contract=off", "-fPIC"],
               "quant_q8.c": ["-O3", "-march=x86-64-v2", "-mtune=native", "-fno-fast-math", "-ffp-contract=off",
                              "-fPIC", "-fopenmp"]}
EXACT_FLAGS["quant_q8_tiles.c"] = EXACT_FLAGS["quant_q8_packed.c"] = EXACT_FLAGS["quant_q8.c"]


def _torch_libgomp() -> Path | None:
    import torch

    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_id() -> str:
    try:
        return next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        return platform.processor()


@lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    if os.environ.get("FERRY_NO_KERNELS"):
        return None
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        log.warning("no C compiler (%s): using the pure-torch path", cc)
        return None
    gomp = _torch_libgomp()
    if gomp is None:
        log.warning("torch ships no libgomp here: using the pure-torch path")
        return None
    link = [f"-Wl,-rpath,{gomp.parent}", str(gomp), "-lm"]
    text = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    flags = " ".join(COMPILE_FLAGS + link + [f for v in EXACT_FLAGS.values() for f in v])
    key = hashlib.sha256(text + flags.encode() + _cpu_id().encode()).hexdigest()[:16]
    lib = default_cache_dir() / "kernels" / f"ferry-kernels-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".tmp{os.getpid()}.so")
        try:
            # -fopenmp compiles the pragmas; linking torch's libgomp by path (not -lgomp) keeps one runtime.
            objs = [tmp.with_suffix(f".{src.stem}.o") for src in SOURCES]
            for src, obj in zip(SOURCES, objs):
                subprocess.run([cc, *EXACT_FLAGS.get(src.name, COMPILE_FLAGS), "-c", str(src), "-o", str(obj)], check=True,
                               capture_output=True, text=True)
            subprocess.run([cc, "-shared", *map(str, objs), "-o", str(tmp), *link], check=True,
                           capture_output=True, text=True)
            for obj in objs:
                obj.unlink()
        except (subprocess.CalledProcessError, OSError) as e:
            log.warning("could not build the kernels (%s): using the pure-torch path",
                        getattr(e, "stderr", e))
            return None
        tmp.replace(lib)
    so = ctypes.CDLL(str(lib))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    so.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr] + [i64] * 6 + [f32, i64, i64]
    so.paged_decode_attention.restype = None
    so.paged_prefill_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, f32, i64, i64]
    so.paged_prefill_attention.restype = ctypes.c_int
    so.kv_store.argtypes = [ptr, ptr, i64, i64]
    so.kv_store.restype = None
    so.skinny_gemm.argtypes = [ptr, ptr, ptr, i64, i64, i64]
    so.skinny_gemm.restype = None
    so.quant_gemm.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
    so.quant_gemm.restype = None
    so.quant_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64]
    so.quant_dequant.restype = None
    so.quant_q8_isa.argtypes = [i64]
    so.quant_q8_isa.restype = i64
    so.int8_peak.argtypes = [i64, i64]
    so.int8_peak.restype = ctypes.c_double
    so.q8_packed_index.argtypes = [i64, ptr]
    so.q8_packed_index.restype = i64
    so.quant_type_row.argtypes = [i64, ctypes.c_char_p, ptr]
    so.quant_type_row.restype = i64
    so.decode_layers.argtypes = [ptr, i64, ptr, ptr, i64] + [ptr] * 4 + [i64] + [ptr] * 3 + [i64, ptr]
    so.decode_layers.restype = None
    so.rms_norm_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32]
    so.rms_norm_rows.restype = None
    so.rope_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64]
    so.rope_rows.restype = None
    so.gated_act_rows.argtypes = [ptr, ptr, i64, i64, i64]
    so.gated_act_rows.restype = None
    if "FERRY_KERNEL_ARCH" in os.environ:
        so.quant_q8_isa(_arch_q8_isa(cc))
    return so


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
