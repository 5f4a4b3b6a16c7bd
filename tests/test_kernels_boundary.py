"""The C kernel library's boundary (kernels/ferry_kernels.h and the ctypes table that mirrors it),
the flags its sources are built with, and where the kernels run: elsewhere the torch path runs."""
from __future__ import annotations

import ctypes
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.model import kernels as K
from ferry.model.kernels import SIGNATURES, STRUCTS, check_abi, load_kernels, source_flags

i64, ptr = ctypes.c_int64, ctypes.c_void_p


@pytest.fixture(scope="module")
def lib():
    so = load_kernels()
    if so is None:
        pytest.fail("the kernels could not be built (no C compiler?)")
    return so


def test_the_library_s_boundary_is_the_ctypes_table(lib):
    check_abi(lib)
    assert set(SIGNATURES) >= {"quant_gemm", "paged_decode_attention", "quant_type_traits"}


def test_a_struct_mirror_of_another_size_is_refused_by_name(lib):
    class Wider(ctypes.Structure):
        _fields_ = [*K.QtTraits._fields_, ("packable", i64)]  # a field the C struct lacks

    with pytest.raises(RuntimeError, match=r"sizeof\(ferry_qt_traits_t\): library 64, Python 72"):
        check_abi(lib, structs={**STRUCTS, "ferry_qt_traits_t": Wider})


@pytest.mark.parametrize("change", ["one argument less", "int32 for int64", "a float return", "absent",
                                    "one function more"])
def test_a_signature_that_differs_is_refused_by_name(lib, change):
    """Argument counts and kinds, return kinds and names are all compared, each way."""
    table = dict(SIGNATURES)
    restype, argtypes = table["quant_gemm"]
    if change == "one argument less":
        table["quant_gemm"] = (restype, argtypes[:-1])
    elif change == "int32 for int64":
        table["quant_gemm"] = (restype, [*argtypes[:-1], ctypes.c_int])
    elif change == "a float return":
        table["quant_gemm"] = (ctypes.c_float, argtypes)
    elif change == "absent":
        del table["quant_gemm"]
    else:
        table["quant_gemm_twice"] = (restype, argtypes)
    name = "quant_gemm_twice" if change == "one function more" else "quant_gemm"
    with pytest.raises(RuntimeError, match=rf"ferry_kernels.h\) differs .*\b{name}: library "):
        check_abi(lib, signatures=table)


def test_every_kernel_source_is_compiled_against_the_boundary_header():
    """Each source includes ferry_kernels.h (directly or through quant_types.h), so the compiler
    checks its definitions against the prototypes the Python table mirrors."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: the kernels cannot be built here")
    for src in K.SOURCES:
        deps = subprocess.run([cc, *source_flags(src.name), "-M", str(src)], check=True, capture_output=True,
                              text=True).stdout
        assert "ferry_kernels.h" in deps, src.name


def _uses_infinities(src: Path) -> bool:
    """Whether a source, or a kernel header it includes, computes with infinities or NaNs."""
    text = src.read_text()
    for header in re.findall(r'#include "([^"]+)"', text):
        if src.with_name(header).is_file():
            text += src.with_name(header).read_text()
    return re.search(r"\bINFINITY\b|\bisinf\b|\bisnan\b|\bHUGE_VALF?\b|__builtin_inf", text) is not None


def _assumes_finite(flags: list[str]) -> bool:
    """Whether these flags let the compiler assume no value is infinite (the last word wins)."""
    finite = False
    for f in flags:
        if f in ("-ffast-math", "-ffinite-math-only"):
            finite = True
        elif f in ("-fno-fast-math", "-fno-finite-math-only"):
            finite = False
    return finite


def test_sources_that_mask_with_infinities_are_not_built_assuming_finite_math():
    """Attention masks scores with -INFINITY and takes exp(-inf) as 0: -ffast-math's promise of
    finite values would let the compiler drop what that needs; those files keep the rest of it."""
    users = [src.name for src in K.SOURCES if _uses_infinities(src)]
    assert {"paged_attention.c", "prefill_attention.c"} <= set(users)
    for name in users:
        assert not _assumes_finite(source_flags(name)), (name, source_flags(name))
        assert "-ffast-math" in source_flags(name) or "-fno-fast-math" in source_flags(name), name


def test_a_machine_other_than_x86_64_runs_the_torch_path_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(K.platform, "machine", lambda: "aarch64")
    load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=K.__name__):
            assert load_kernels() is None
    finally:
        load_kernels.cache_clear()  # the next caller loads the library as this machine has it
    lines = [r.getMessage() for r in caplog.records if r.name == K.__name__]
    assert len(lines) == 1 and "x86-64" in lines[0] and "aarch64" in lines[0], lines


# Greedy tokens and each prompt token's logprob, on whichever path the process has.
RUN = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
from ferry.model.kernels import load_kernels
from ferry import LLM, SamplingParams
prompts = json.loads(sys.stdin.read())
llm = LLM(quant_activations="exact")
sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
outs = llm.generate(prompts, sp, use_tqdm=False)
print("RESULT " + json.dumps({"kernels": load_kernels() is not None, "use_kernel": llm.engine.executor.model.use_kernel,
    "runs": [[o.outputs[0].token_ids, [lps[j][p[j]] for j in range(1, len(p))]]
             for p, o, lps in ((p, o, o.prompt_logprobs) for p, o in zip(prompts, outs))]}))
"""


def test_ferry_no_kernels_runs_the_torch_path_with_the_kernels_results(exact_llm, parity_prompts):
    """FERRY_NO_KERNELS=1: one log line says why the kernels are off, the model runs on torch (its
    GGUF dequantized at load), and its greedy tokens and prompt logprobs are the kernel path's
    (within the parity tests' 1e-3)."""
    from ferry import SamplingParams

    prompts = parity_prompts[:3]
    env = {**__import__("os").environ, "FERRY_NO_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", RUN], input=json.dumps(prompts), env=env, capture_output=True,
                       text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    off = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith(f"LOG {K.__name__} ")]
    assert len(off) == 1 and "FERRY_NO_KERNELS" in off[0] and "torch path" in off[0], off
    torch_path = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert not torch_path["kernels"] and not torch_path["use_kernel"]
    exact_llm.engine.reset_prefix_cache()  # computed here, not reused from other batch shapes
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outs = exact_llm.generate(prompts, sp, use_tqdm=False)
    assert exact_llm.engine.executor.model.use_kernel
    for p, out, (tokens, logprobs) in zip(prompts, outs, torch_path["runs"]):
        assert out.outputs[0].token_ids == tokens
        kernel = [out.prompt_logprobs[j][p[j]] for j in range(1, len(p))]
        assert max(abs(a - b) for a, b in zip(kernel, logprobs)) < 1e-3
