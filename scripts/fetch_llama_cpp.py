"""Fetch llama.cpp's Python tools (its convert_hf_to_gguf.py, conversion/, gguf-py/ and chat
templates) for the tests that check ferry reads the GGUF files llama.cpp writes.

llama.cpp's Python sources ship inside llama-cpp-python's source distribution on PyPI, so pip
downloads them (no compiler, no llama.cpp build). Usage: python scripts/fetch_llama_cpp.py DEST
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's version; its vendor/llama.cpp is the converter the tests use
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")


def fetch(dest: Path) -> None:
    """Extract llama.cpp's converter and its modules into ``dest`` (kept if already there)."""
    if (dest / "convert_hf_to_gguf.py").is_file():
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        part = dest.with_name(dest.name + ".part")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and any(m.name[len(prefix):].startswith(w) for w in WANTED) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(part, members=members, filter="data")
        part.rename(dest)


if __name__ == "__main__":
    fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".venv/llama.cpp"))
