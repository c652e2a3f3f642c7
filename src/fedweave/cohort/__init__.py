"""Vectorised cohorts: a simulated round's clients trained as one computation per group.

- :mod:`.eligibility`: which strategies, models, losses and clients may (and why not);
- :mod:`.schedule`: each client's batches, drawn as the sequential loop draws them;
- :mod:`.optim`: SGD and Adam on stacked parameters, masked per client, and the workspace a model's cohorts reuse;
- :mod:`.layered`: the fast path for chains of Linear layers (MLPs): batched products, the backward written out;
- :mod:`.vectorised`: one group's training, on that fast path or with ``torch.func`` (``functional_call``, ``vmap``);
- :mod:`.trainer`: a batch of clients' work, the training jobs grouped into cohorts;
- :mod:`.transport`: the in-memory link that trains its clients in cohorts (``simulation.cohort``);
- :mod:`.workers`: ``simulation.workers`` processes sharing the clients' work;
- :mod:`.parcel`: how the workers' messages are packed (each storage once, large ones in shared memory).
"""
