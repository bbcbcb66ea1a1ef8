"""Exercise (lesson 11): the forward of a row-parallel Linear, Megatron-LM's second layer."""

import torch
import torch.distributed as dist


class SumOverRanks(torch.autograd.Function):
    """Megatron's g: every rank's partial output summed in forward; in backward the gradient
    passes through unchanged, since every rank holds the whole output and so already has the
    whole dL/dy. A bare dist.all_reduce has no autograd formula: torch warns that backward
    through it "may lead to silently incorrect behavior"."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()  # all_reduce writes in place: keep the caller's tensor intact
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def row_parallel_forward(h_shard: torch.Tensor, weight_shard: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    """This rank holds some columns of the input h and the same columns of the weight: its
    product is a partial sum of the output. One all-reduce (a sum, inside g) makes the whole
    output on every rank; the bias is added once, after it (added before, it would count N
    times)."""
    y = SumOverRanks.apply(h_shard @ weight_shard.T)
    return y + bias
