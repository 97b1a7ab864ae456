"""Model families: how each family wires its layer from gemma_jax.layers."""
