"""Example models and trainers for jaxtier (a Llama-style decoder in Flax NNX)."""
