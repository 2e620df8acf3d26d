"""Other engines that serve our heads, driven from headstart without importing them (vLLM)."""
