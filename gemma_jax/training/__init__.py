"""Training: data, tokenizers, optimizer, loss, steps, checkpoints, metrics, the loop."""
