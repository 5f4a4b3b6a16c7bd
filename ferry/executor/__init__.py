"""Executors turn a scheduler output into sampled tokens."""
