"""qerl: reinforcement learning of LLMs on 4-bit weights (QeRL, arXiv 2510.11696)."""

__version__ = "0.1.0"
