"""Topologies decide who aggregates for whom and which transport each link uses."""
