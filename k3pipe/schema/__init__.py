"""The experiment as data: the pydantic specs (experiment, arms, engines, launchers, workloads,
decision) and the schedule of launches. Imports core and verdicts."""
