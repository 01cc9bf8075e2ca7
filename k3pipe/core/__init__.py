"""The ground floor: errors, secrets, settings, processes, figures, provenance, owners and the MLflow
record's layout (every tag, label and run kind k3pipe writes). Imports nothing of k3pipe above it."""
