"""The OpenAI API routes, one module per endpoint."""
