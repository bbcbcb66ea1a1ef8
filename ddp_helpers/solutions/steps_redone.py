"""Solution (lesson 08): how many steps a restart redoes when a rank dies at `fault_step`."""


def steps_redone(fault_step: int, ckpt_every: int) -> int:
    """Steps finished after the last checkpoint and before the rank died at fault_step."""
    finished = fault_step - 1  # every rank finished the step before the kill (lesson's barrier)
    last_checkpoint = finished // ckpt_every * ckpt_every
    return finished - last_checkpoint  # at most ckpt_every - 1: the interval bounds the loss
