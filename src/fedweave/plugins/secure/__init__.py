"""Secure aggregation (SecAgg / SecAgg+) and homomorphic encryption (CKKS): plugins the
server combines while encoded, so it learns the sum of the updates and nothing else."""
