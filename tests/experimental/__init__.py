"""Tests of jaxtier/experimental/: DHA compute and the multi-path fetch."""
