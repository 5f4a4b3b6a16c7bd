"""Tool calling: the request's tools and tool_choice (``spec.py``), the prompt they add
(``render.py``), the grammar that enforces a required or named call (``grammar.py``), and one
parser per model output format (``parsers/``, registered by name)."""
