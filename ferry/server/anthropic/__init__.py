"""The Anthropic Messages API routes."""
