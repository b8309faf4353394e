"""Training: the step shared by bench, trainer and grader; A2 trainer, checkpoints, sweeps."""
