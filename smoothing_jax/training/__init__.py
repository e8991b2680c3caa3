"""Training: the loop (``train``), its compiled steps, losses, optimisers, callbacks, the
trajectory recorder, metric writers, and deep ensembles trained as one job."""
