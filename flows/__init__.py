"""Prefect flows: composition only; the work is in k3pipe/ and tasks/."""
