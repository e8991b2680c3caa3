"""The objectives and predictives of the Bayesian baselines: iBNN (``ibnn``) and BNN-VI
(``bnnvi``)."""
