"""The reference stage: sampling, scoring, FP64 targets, the update, controls, clip branches."""
