"""Thin Prefect tasks: each calls one k3pipe library function, logs, and returns its result."""
