"""Jobs: an experiment's lifetime in the library, as :mod:`k3pipe.jobs.arm_run` is an arm's. Each job takes a
typed request and a :class:`~k3pipe.jobs.steps.Job` (settings, tracker, steps, how it logs and
publishes) and returns a typed result; a flow is its Prefect shell (``flows/``), passing its tasks as
the steps.

- :mod:`k3pipe.jobs.prepare`: the preparation every job runs first (preflight, models, prompts);
- :mod:`k3pipe.jobs.benchmark`: each arm in turn, or one arm rerun from its record;
- :mod:`k3pipe.jobs.study`: every arm x workload under one run, launches interleaved, the report;
- :mod:`k3pipe.jobs.retest`: the baseline and each variant as studies, judged in one report."""
