"""minippo: asynchronous PPO for LLMs on one node, with off-policy corrections you can trust."""

__version__ = "0.1.0"
