"""The node and what it costs: GPUs and facts, the engine's /metrics, dollars and energy. Imports
engines, schema and below."""
