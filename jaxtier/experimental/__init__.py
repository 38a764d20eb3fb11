"""Mechanisms not yet reached from `jaxtier.offload`: their API may change."""
