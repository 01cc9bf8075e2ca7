"""A workload's prompts, drawn before any engine starts: tokenizers, random and shared-prefix sets,
ShareGPT, documents and the corpora that cache them. Imports schema and below."""
