"""rbee-worker: one LLM on one device, streamed to many clients, registered with the rbee pool manager."""

__version__ = "0.1.0"
