"""Who trains each round and with how much work: the federated controller protocol, the static and
adaptive controllers, and selection."""
