"""Training: the loop (``train``), its compiled steps, optimisers, callbacks, the trajectory
recorder and metric writers; what differs between methods (objective, optimiser rules, train
state and step, a deep ensemble's stacked members) each method says (``smoothing_jax.methods``)."""
