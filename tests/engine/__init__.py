"""Tests that need the real vLLM CPU engine (the session's `vllm_engine`, or its venv)."""
