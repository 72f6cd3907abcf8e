"""rbee-worker: one LLM on one device, streamed to many clients, registered with the rbee pool manager."""

from rbee_worker.hardware.cpu_features import force_isa_environment

__version__ = "0.1.0"

# Before any of torch's kernels run: torch and oneDNN read their instruction-set caps once, at first use.
force_isa_environment()
