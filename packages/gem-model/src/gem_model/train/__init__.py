"""Building a run (model preparation, optimizers), the training loop, checkpoints and metrics."""
