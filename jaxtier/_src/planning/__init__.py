"""jaxtier's planning stage."""
