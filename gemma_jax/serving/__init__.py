"""Serving: many requests decoded together on paged KV caches.

`engine` (continuous batching, preemption, the engine thread) over `paged_model` (the
compiled prefill-chunk and decode-step programs), `pages` and `sequences` (who holds
which page, the prefix cache), `sampling` (token choice per row), `stops` (stop
strings), `images` (image spans in prompts); `requests` (what a client asks and gets);
`server` and `openai_api` (the OpenAI-compatible HTTP server).
"""
