"""Deployments onto clusters: ``fedweave deploy k8s`` (:mod:`fedweave.deploy.kubernetes`)."""
