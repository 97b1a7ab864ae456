"""Inference: KV-cached prefill and decode steps, sampling from a trained model, and
multi-turn chat over one cache, and streamed text."""

from gemma_jax.inference.chat_session import ChatSession
from gemma_jax.inference.decoding import Cache, Decoding, make_decoding
from gemma_jax.inference.sampler import Sampler, Samples, generate
from gemma_jax.inference.sampling import Sampling
from gemma_jax.text.text_stream import TextStream

__all__ = ["Cache", "ChatSession", "Decoding", "Sampler", "Samples", "Sampling", "TextStream",
           "generate", "make_decoding"]
