"""Serving: many requests decoded together on a paged KV cache (`engine`), token choice
per row (`sampling`), the request and output types (`requests`), and an
OpenAI-compatible HTTP server (`server`)."""
