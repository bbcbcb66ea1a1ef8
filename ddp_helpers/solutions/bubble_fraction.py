"""Prediction (lesson 11): the pipeline bubble, the fraction of a step each stage sits idle."""


def bubble_fraction(p: int, m: int) -> float:
    """p stages, m micro-batches, every forward and every backward one time unit on every stage
    (GPipe or 1F1B alike): the first micro-batch's forward reaches the last stage after p - 1
    units, and the last backward reaches the first stage p - 1 units after the last stage is
    done; each stage is busy 2m units of a step of 2(m + p - 1)."""
    return (p - 1) / (m + p - 1)


answer = bubble_fraction
