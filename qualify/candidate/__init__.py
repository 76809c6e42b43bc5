"""The candidate stage: the launcher, the trainer cells, the sampler cells."""
