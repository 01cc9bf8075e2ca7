"""Operations tools built on the library, never imported by it: the team stack on one machine
(:mod:`k3pipe.ops.stack`: PostgreSQL, MLflow, Prefect, a work pool and its worker) and offline bundles for
an air-gapped node (:mod:`k3pipe.ops.bundle`, with its installer ``install.sh``). ``k3pipe stack`` and
``k3pipe bundle`` are their command lines."""
