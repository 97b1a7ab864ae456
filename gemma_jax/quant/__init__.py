"""Quantization: int8 / int4 weights, int8 training, int8 KV caches (see README)."""
