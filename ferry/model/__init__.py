"""Model definitions on packed tokens, attention, weight loading, tokenizer."""
