"""Orchestration above the stages: ``qualify run``'s chain and the Slurm submission."""
