"""Exercise (lesson 06): the linear scaling rule for the learning rate."""


def scaled_lr(base_lr: float, base_batch: int, batch_per_rank: int, world_size: int) -> float:
    """The rate tuned for `base_batch`, scaled by how much bigger the effective batch is."""
    effective_batch = batch_per_rank * world_size  # DDP averages the ranks' gradients
    return base_lr * effective_batch / base_batch
