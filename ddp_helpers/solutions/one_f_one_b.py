"""Exercise (lesson 11): the 1F1B order of one pipeline stage (PipeDream-Flush, as in Megatron-LM
and torch.distributed.pipelining's Schedule1F1B)."""


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s order: warm up with as many forwards as there are stages after it (never
    more than there are micro-batches), then alternate one forward and one backward, then the
    backwards that are left, each micro-batch's backward in the order of the forwards."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):  # steady state: a forward, then the oldest backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order
