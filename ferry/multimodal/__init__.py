"""Image inputs: loading and decoding (images.py), the model family's prompt expansion (processor.py)."""
