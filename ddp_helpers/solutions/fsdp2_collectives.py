"""Prediction (lesson 10): FSDP2's collectives in one step of the lesson's model, wrapped as
three blocks plus the root (the first and last layers)."""

BLOCKS = 3
# Forward all-gathers each of the 4 groups' parameters (3 blocks + the root). Each block is
# resharded after its forward, so backward all-gathers the 3 blocks again; the root is not
# resharded (backward needs it at once). Backward reduce-scatters every group's gradients once.
answer = {"all_gather": 2 * BLOCKS + 1, "reduce_scatter": BLOCKS + 1}
