"""Vectorised cohorts: a simulated round's clients trained as one computation per group.

- :mod:`.eligibility`: which strategies, models, losses and clients may (and why not);
- :mod:`.schedule`: each client's batches, drawn as the sequential loop draws them;
- :mod:`.optim`: SGD and Adam on stacked parameters, masked per client;
- :mod:`.vectorised`: one group's training with ``torch.func`` (``functional_call``, ``vmap``, ``grad``);
- :mod:`.transport`: the in-memory link that trains its clients in cohorts (``simulation.cohort``).
"""
