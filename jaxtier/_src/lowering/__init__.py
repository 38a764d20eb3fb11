"""jaxtier's lowering stage."""
