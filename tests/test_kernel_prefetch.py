"""The weight prefetches of the q8 products are in the compiled code: gcc 12 silently drops
_mm_prefetch inlined from a plain function into a target function (it had dropped every one of
them), and no product result shows it, only the instructions."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ferry.model import kernels as K


@pytest.mark.parametrize("name", ["quant_q8_packed.c"])
def test_the_q8_products_keep_their_prefetch_instructions(name, tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: the kernels cannot be built here")
    src = Path(K.__file__).with_name(name)
    asm = tmp_path / "out.s"
    subprocess.run([cc, *K.EXACT_FLAGS[name], "-I", str(src.parent), "-S", str(src), "-o", str(asm)],
                   check=True, timeout=300)
    assert asm.read_text().count("prefetcht1") > 0, f"{name} compiled without its prefetches"
