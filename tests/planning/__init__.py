"""Tests of jaxtier/_src/planning/: cost formulas, the solver, policies, the planner."""
