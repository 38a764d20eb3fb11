"""jaxtier's analysis stage."""
