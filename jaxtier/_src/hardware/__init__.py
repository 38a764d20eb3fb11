"""jaxtier's hardware stage."""
