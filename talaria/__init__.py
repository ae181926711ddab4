"""Talaria: session-aware serving of several LLMs on one tensor-parallel group."""
__version__ = "0.1.0"
