"""The `rl360` CLI's machinery: recipes, cluster connection, placement, preflight checks."""
