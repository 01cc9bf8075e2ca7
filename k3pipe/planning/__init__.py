"""An arm's plan (engine, command line, GPUs, mounts) and its cold start read from the engine's log.
Imports sources, engines, schema and below."""
