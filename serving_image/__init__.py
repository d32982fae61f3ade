"""The OpenAI-compatible HTTP server around the kiln runtime (`kiln serve`)."""
