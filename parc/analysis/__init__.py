"""Read-only analyses of IR graphs (reports, statistics)."""
