"""Jobs: an experiment's lifetime in the library, as :mod:`k3pipe.run` is an arm's. So far the
preparation every job shares (:mod:`k3pipe.jobs.prepare`); the benchmark, study, retest and rerun
bodies still live in ``flows/`` (issue 28)."""
