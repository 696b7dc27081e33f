"""Ray actors: rollout controller, trajectory buffer, trainer group, parameter broadcaster,
env actor pool, metrics sink. Each module imports Ray (and its own heavy deps) itself."""
