"""FreeToken (`ft`): an LLM serving engine for large mixture-of-experts models on small GPUs."""

__version__ = "0.1.0"
