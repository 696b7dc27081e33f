"""Environments: the Env API users subclass, the env registry, sandboxes, tools, task formats
and the built-in agent loop. Import submodules directly (rl360.envs.api, rl360.envs.sandbox, ...);
this package imports nothing heavy."""
