"""The verl stack adapter (``harnesses/verl/README.md``): verl's own PPO actor and critic update."""
