"""Inference: KV-cached prefill and decode steps, and sampling from a trained model."""

from gemma_jax.inference.decoding import Cache, Decoding, make_decoding
from gemma_jax.inference.sampler import Sampler, Samples, generate

__all__ = ["Cache", "Decoding", "Sampler", "Samples", "generate", "make_decoding"]
