"""Where the tests find llama.cpp: its Python tools (converter, gguf-py, templates; fetched by
`make test` into .venv/llama.cpp, or FERRY_LLAMA_CPP) and, optionally, its built binaries
(FERRY_LLAMA_CPP_BIN, default the tree's build/bin)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ.get("FERRY_LLAMA_CPP", ROOT / ".venv" / "llama.cpp"))
LLAMA_BIN = Path(os.environ.get("FERRY_LLAMA_CPP_BIN", LLAMA_CPP / "build" / "bin"))
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
HAS_CONVERTER = CONVERTER.is_file()
