"""Gemma 4: its decoder layer (`layer`, with shared key/value layers and MoE),
per-layer inputs (`per_layer_inputs`), vision tower (`vision`) and image preprocessing
(`images`)."""
