"""SPMD strategy search (Rhino section 4): strategies per node, cost arrays, solve, apply."""
