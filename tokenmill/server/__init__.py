"""The HTTP server: OpenAI-compatible routes in front of an engine-core process (see app.py)."""
