"""Real servers (MLflow, Prefect, PostgreSQL), command lines run as subprocesses, scripted engines."""
