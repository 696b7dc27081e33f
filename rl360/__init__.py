"""RL360: fully asynchronous RL post-training for coding and tool-using agents, on Ray."""

__version__ = "0.1.0"
