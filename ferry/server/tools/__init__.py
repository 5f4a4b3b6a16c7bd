"""Tool calling: the request's tools and tool_choice (``spec.py``), the prompt they add
(``render.py``) and the grammar that enforces a required or named call (``ToolSpec.grammar``), and
one parser per model output format (``parsers/``, registered by name)."""
