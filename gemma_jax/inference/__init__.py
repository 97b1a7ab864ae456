"""Inference: KV-cached prefill and decode steps, sampling from a trained model, and
multi-turn chat over one cache."""

from gemma_jax.inference.chat_session import ChatSession
from gemma_jax.inference.decoding import Cache, Decoding, make_decoding
from gemma_jax.inference.sampler import Sampler, Samples, generate

__all__ = ["Cache", "ChatSession", "Decoding", "Sampler", "Samples", "generate", "make_decoding"]
