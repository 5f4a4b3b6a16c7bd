"""llama.cpp's converter for the image-model tests: the text GGUF of a model directory, or with
``mmproj`` its vision tower's (a test helper; the tests that use it skip without a llama.cpp tree)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.llama_cpp import HAS_CONVERTER as HAVE_CONVERTER, LLAMA_CPP  # noqa: F401 (the tests import both from here)

# Runs the converter; without a tokenizer.model its Qwen vocabulary path falls through to the BPE
# one before it imports sentencepiece (which need not be installed).
RUN_CONVERTER = """import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
from conversion import base
_orig = base.TextModel._create_vocab_sentencepiece
def _create(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return _orig(self)
base.TextModel._create_vocab_sentencepiece = _create
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model_dir: Path, out: Path, outtype: str, mmproj: bool = False) -> Path:
    """llama.cpp's converter on ``model_dir``: the text GGUF, or with ``mmproj`` the tower's."""
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    cmd = [sys.executable, "-c", RUN_CONVERTER, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(model_dir),
           "--outtype", outtype, "--outfile", str(out)] + (["--mmproj"] if mmproj else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def smollm2_tokenizer(extra: list[str]):
    """SmolLM2's tokenizer (one llama.cpp's converter knows) with ``extra`` as special tokens."""
    import transformers as tf

    from ferry.model.loader import resolve_model_dir

    tok = tf.AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok
