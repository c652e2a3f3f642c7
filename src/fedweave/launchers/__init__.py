"""Launchers start the nodes of a run: in-process (local) now; processes, Ray, Slurm, Kubernetes later."""
