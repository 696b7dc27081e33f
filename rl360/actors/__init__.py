"""Ray actors of a training run: the rollout controller, the trajectory buffer, the trainer
group, the env actor pool (and its session client) and the metrics sink. The weight publisher
lives with the rest of weight sync in rl360.weights."""
