"""One experiment: its config, model spec, workdir and lock, checkpoints, ``init_from`` and
the ``Run`` that holds them (``Run.from_config``, ``Run.from_workdir``)."""
