"""The model families by `config.model.block_type`: each one's layer and plan of layers
(`models.plan.Family`). The decoder reads a family only through here."""

from gemma_jax.models.gemma3.layer import Gemma3Layer
from gemma_jax.models.gemma4.plan import FAMILY as GEMMA4
from gemma_jax.models.gpt3 import Gpt3Layer
from gemma_jax.models.parallel import ParallelLayer
from gemma_jax.models.plan import Family

FAMILIES = {"gemma3": Family(Gemma3Layer), "gemma4": GEMMA4, "gpt3": Family(Gpt3Layer),
            "parallel": Family(ParallelLayer)}
