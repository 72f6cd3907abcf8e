"""Chat output beyond plain text: tool calls parsed from or constrained into what a model writes (tools.py), and a
reasoning model's thinking kept apart from its answer (reasoning.py)."""
