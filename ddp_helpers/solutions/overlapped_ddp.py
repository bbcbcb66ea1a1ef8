"""Exercise (lesson 09): start each gradient's all-reduce in backward, as soon as it is ready."""

import torch
import torch.distributed as dist


def attach_overlap_hooks(model: torch.nn.Module) -> list:
    """Register a hook on every parameter that gets a gradient; the hook starts an asynchronous
    all-reduce of that gradient. Return the list the hooks fill with (parameter, work)."""
    pending = []

    def start_all_reduce(p: torch.Tensor) -> None:
        # Runs once p.grad holds this backward's whole gradient (a tied weight's two parts too).
        pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    for p in model.parameters():
        if p.requires_grad:  # a frozen parameter gets no gradient and takes no hook
            p.register_post_accumulate_grad_hook(start_all_reduce)
    return pending


def finish_overlap(pending: list) -> None:
    """Before optimizer.step(): wait for every all-reduce started in backward, then average."""
    for p, work in pending:
        work.wait()
        p.grad /= dist.get_world_size()
    pending.clear()  # the next backward starts an empty list
