"""What a run records and how it is read back: the MLflow tracker, the spool and its push, the arm's
recorder, comparisons, history, priors and the design's look-ahead. Imports bench, machine, launchers
and below; the report and the jobs read it."""
