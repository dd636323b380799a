"""KMesh: keyed inference state shared across related LLM requests."""

__version__ = "0.1.0"
