"""Tests of jaxtier/_src/primitives/: the custom calls (fused host update, streaming)."""
