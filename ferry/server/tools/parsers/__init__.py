"""Tool-call parsers, one module per model output format, registered by name.

A parser says where a call starts (a marker, or only at the very start of the output) and where
it ends (a marker, or the end of the output), and how to read the calls between; ``extract`` and
``ToolStream`` (``base.py``) do the rest for every format.
"""
from __future__ import annotations

from ferry.server.tools.parsers.base import PARSERS, ToolParser, ToolStream, extract, parser_for_template
# qwen_xml first: parser_for_template takes the first parser whose mark a template holds, and a
# template writing <function= calls writes hermes's <tool_call> around them.
from ferry.server.tools.parsers import qwen_xml  # noqa: F401  (it registers)
from ferry.server.tools.parsers import generic_json, hermes, llama3, mistral  # noqa: F401  (they register)
from ferry.server.tools.parsers import harmony  # noqa: F401  (it registers)

__all__ = ["PARSERS", "ToolParser", "ToolStream", "extract", "parser_for_template"]
