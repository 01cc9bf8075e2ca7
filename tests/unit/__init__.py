"""The fast tier (`pytest -m unit`): no engine, Docker, Prefect or MLflow server, subprocess or browser."""
