"""Lesson 12's exercises: for each bug, wrong diagnoses and wrong fixes FAIL naming the case,
and right ones written differently from the kit's solution PASS. The fixes run on real gloo
ranks at 2 and 3 ranks; a fix that still hangs is named by the kit, never waited for."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

PREDICTIONS = {  # name: (right answers written differently, wrong answers)
    "hang_step": ([4, "4", "step 4", 4.0], [0, 5, "step 9", "rank 0", "4 or 9"]),
    "missing_label": ([9, "label 9", "9"], [0, 8, 10, "rank 1", "8 and 9"]),
    "update_factor": ([2, 2.0, "2x", "2.0x", "2.0 times larger", "twice", "world_size"],
                      [1, 0.5, 4, "4.0x", "half", "N/2 = 1"]),
    "extra_batch_rank": ([0, "rank 0", "0"], [1, "rank 1", 2, "both", "3"]),
    "bad_sample": ([13, "sample 13", "13"], [1, 12, 6, "rank 1", "step 3"]),
    "seed_differs": (["model", "model.weight", "the weights", "initial weights",
                      "the weights; the data x should differ",
                      "model.weight and model.bias (x may differ)"],
                     ["x", "data", "the model and x", "x, not the model", "y", "nothing"]),
    "drifting_buffer": (["model.1.running_mean", "running_var", "the BatchNorm buffers"],
                        ["model.1.weight", "model.0.weight", "bias", "gradients",
                         "num_batches_tracked", "the buffer num_batches_tracked"]),
    "distinct_orders": ([1, "1", "one"], [3, 2, "three", 0, "1 or 3"]),
}


@pytest.mark.parametrize("name", sorted(PREDICTIONS))
def test_diagnoses(name, tmp_path):
    right, wrong = PREDICTIONS[name]
    assert_all_pass(name, verdicts(name, {repr(a): a for a in right}, tmp_path))
    lines = verdicts(name, {repr(a): a for a in wrong}, tmp_path)
    assert_all_fail(name, lines, {repr(a): "" for a in wrong})


def test_the_fixes_checked_on_two_world_sizes_name_the_case(tmp_path):
    """One wrong fix per bug that passes on 2 ranks and fails on 3 (a world size written in)."""
    lines = {
        "report_loss": verdicts("report_loss", {"/ 2": edit(
            "report_loss", "avg /= dist.get_world_size()", "avg /= 2")}, tmp_path),
        "average_gradients": verdicts("average_gradients", {"/ 2": edit(
            "average_gradients", "p.grad /= dist.get_world_size()", "p.grad /= 2")}, tmp_path),
        "class_counts": verdicts("class_counts", {"minlength=10": edit(
            "class_counts", "minlength=num_classes", "minlength=10")}, tmp_path),
    }
    for name, got in lines.items():
        assert_all_fail(name, got, {k: "3 ranks" for k in got})


WRONG_FIXES = {  # name: {label: (source, text the FAIL must name)}
    "report_loss": {
        "a sleep before the all-reduce": (
            edit("report_loss", "    avg = loss.detach().clone()\n",
                 "    import time\n    time.sleep(0.2)\n    if dist.get_rank() != 0:\n"
                 "        return None\n    avg = loss.detach().clone()\n"),
            "2 ranks, steps 0..9: Collectives do not match"),
        "a barrier on the other ranks": (
            edit("report_loss", "    avg = loss.detach().clone()\n",
                 "    if dist.get_rank() != 0:\n        dist.barrier()\n        return None\n"
                 "    avg = loss.detach().clone()\n"),
            "2 ranks, steps 0..9: Collectives do not match"),
        "the average on rank 0 only": (
            edit("report_loss", "    return avg.item()", "    return avg.item() if "
                 "dist.get_rank() == 0 else None"),
            "what rank 1 returned: at step 4: got None"),
        "printed on every rank, to stderr": (
            edit("report_loss", "    if dist.get_rank() == 0:\n"
                 "        print(f\"step {step}: mean loss {avg.item():.3f}\")",
                 "    import sys\n    print(f\"step {step}: mean loss {avg.item():.3f}\", "
                 "file=sys.stderr)"),
            "2 ranks, steps 0..9: rank 1 prints nothing (only rank 0 prints): it printed 2 "
            "line(s)"),
        "summed, not averaged": (
            edit("report_loss", "    avg /= dist.get_world_size()\n", ""),
            "what rank 0 returned: at step 4: got 13"),
        "printed on every rank": (
            edit("report_loss", "if dist.get_rank() == 0:", "if dist.get_rank() >= 0:"),
            "2 ranks, steps 0..9: rank 1 prints nothing (only rank 0 prints): it printed 2 "
            "line(s)"),
    },
    "class_counts": {
        "bincount without minlength": (
            edit("class_counts", ", minlength=num_classes", ""),
            "2 ranks, 10 classes: Collectives do not match"),
        "padded on rank 1 only": (
            edit("class_counts", ", minlength=num_classes", ", minlength=num_classes if "
                 "dist.get_rank() == 1 else 0"),
            "3 ranks, 7 classes: Collectives do not match"),
        "not summed over ranks": (
            edit("class_counts", "    dist.all_reduce(counts)\n", ""),
            "2 ranks, 10 classes: rank 0's counts: at index 0: got 1, expected 3"),
    },
    "average_gradients": {
        "summed (the bug)": (
            edit("average_gradients", "        p.grad /= dist.get_world_size()", ""),
            "2 ranks: rank 0's weight gradient"),
        "divided twice": (
            edit("average_gradients", "        p.grad /= dist.get_world_size()",
                 "        p.grad /= dist.get_world_size() ** 2"),
            "2 ranks: rank 0's weight gradient"),
        "divided on rank 0 only": (
            edit("average_gradients", "        p.grad /= dist.get_world_size()",
                 "        if dist.get_rank() == 0:\n            p.grad /= "
                 "dist.get_world_size()"),
            "2 ranks: rank 1's weight gradient"),
    },
    "train_epoch": {
        "no agreement (the bug)": (
            edit("train_epoch", "    dist.all_reduce(steps, op=dist.ReduceOp.MIN)", ""),
            "2 ranks with [3, 2] batches: Collectives do not match"),
        "a barrier at the start": (
            edit("train_epoch", "    dist.all_reduce(steps, op=dist.ReduceOp.MIN)",
                 "    dist.barrier()"),
            "2 ranks with [3, 2] batches: Collectives do not match"),
        "MAX instead of MIN": (
            edit("train_epoch", "ReduceOp.MIN", "ReduceOp.MAX"),
            "2 ranks with [3, 2] batches: Collectives do not match"),
        "two steps written in": (
            edit("train_epoch", "batches[:int(steps)]", "batches[:2]"),
            "3 ranks with [2, 2, 1] batches: Collectives do not match"),
    },
    "train_step": {
        "skipped on the bad rank only": (
            edit("train_step", "    dist.all_reduce(bad)  # how many ranks hold a bad batch: "
                 "the same answer on every rank\n", ""),
            "2 ranks, a NaN on rank 1 at step 1: Collectives do not match"),
        "NaN replaced by zero, no skip": (
            edit("train_step", "    loss = F.mse_loss(model(x), y)\n",
                 "    loss = F.mse_loss(model(x.nan_to_num()), y)\n"),
            "what rank 0 returned at steps 0..3: at index 1: got 1, expected 0"),
        "no check (the bug)": (
            edit("train_step", "    if bad.item() > 0:\n        return False\n", ""),
            "what rank 0 returned at steps 0..3"),
    },
    "build": {
        "one seed for both": (
            edit("build", "    torch.manual_seed(seed + 1 + dist.get_rank())  # then each "
                 "rank its own data\n", ""),
            "2 ranks, seed 0: x on ranks 0 and 1: rank 0 and rank 1 hold the same data"),
        "the rank's seed for both (the bug)": (
            edit("build", "    torch.manual_seed(seed)  # the same on every rank: the same "
                 "initial weights", "    torch.manual_seed(seed + dist.get_rank())"),
            "2 ranks, seed 0: the model's weight: rank 1 differs from rank 0"),
        "broadcast on rank 0 only": (
            edit("build", "    x = torch.randn(8, 4)\n",
                 "    x = torch.randn(8, 4)\n    if dist.get_rank() == 0:\n"
                 "        for p in model.parameters():\n"
                 "            dist.broadcast(p.data, src=0)\n").replace(
                "    torch.manual_seed(seed)  # the same on every rank: the same initial "
                "weights\n", "    torch.manual_seed(seed + dist.get_rank())\n"),
            "2 ranks, seed 0: Collectives do not match"),
    },
    "sync_buffers": {
        "broadcast on rank 0 only": (
            edit("sync_buffers", "    for b in model.buffers():\n",
                 "    if dist.get_rank() != 0:\n        return\n    for b in model.buffers():\n"),
            "2 ranks, 2 steps: Collectives do not match"),
        "the parameters, not the buffers": (
            edit("sync_buffers", "model.buffers()", "model.parameters()").replace(
                "dist.broadcast(b, src=0)", "dist.broadcast(b.data, src=0)"),
            "2 ranks, 2 steps: BatchNorm's running_mean: rank 1 differs from rank 0"),
        "summed, not averaged": (
            edit("sync_buffers", "        dist.broadcast(b, src=0)",
                 "        if b.is_floating_point():\n            dist.all_reduce(b)"),
            "2 ranks, 2 steps: BatchNorm's running_mean (expected the mean over the ranks"),
        "averaged over 2 written in": (
            edit("sync_buffers", "        dist.broadcast(b, src=0)",
                 "        if b.is_floating_point():\n            dist.all_reduce(b)\n"
                 "            b /= 2"),
            "3 ranks, 2 steps: BatchNorm's running_mean (expected the mean"),
    },
    "epoch_orders": {
        "set_epoch forgotten (the bug)": (
            edit("epoch_orders", "        sampler.set_epoch(epoch)\n", ""),
            "2 ranks, 10 samples, seed 0: a new order each epoch"),
        "set_epoch(0)": (
            edit("epoch_orders", "set_epoch(epoch)", "set_epoch(0)"),
            "a new order each epoch: the 3 epochs are the sampler's shuffles at epoch numbers "
            "0, 0, 0"),
        "set_epoch(epoch % 2)": (
            edit("epoch_orders", "set_epoch(epoch)", "set_epoch(epoch % 2)"),
            "epoch numbers 0, 1, 0"),
        "a seed of each rank's own": (
            edit("epoch_orders", "seed=seed)", "seed=seed + dist.get_rank())").replace(
                "from torch.utils", "import torch.distributed as dist\nfrom torch.utils"),
            "rank 1's indices, epochs 0..2"),
        "each rank its own shuffle": (
            "import random\n\nimport torch.distributed as dist\n\n\n"
            "def epoch_orders(n, epochs, seed):\n"
            "    rng = random.Random(seed + dist.get_rank())\n"
            "    out = []\n    for _ in range(epochs):\n"
            "        idx = list(range(dist.get_rank(), n, dist.get_world_size()))\n"
            "        rng.shuffle(idx)\n        out.append(idx)\n    return out\n",
            "rank 0's indices, epochs 0..2"),
    },
}

RIGHT_FIXES = {  # name: {label: source written differently from the kit's solution}
    "report_loss": {"all_reduce then mean of a list": (
        "import torch\nimport torch.distributed as dist\n\n\ndef report_loss(loss, step):\n"
        "    if (step + 1) % 5:\n        return None\n"
        "    parts = [torch.zeros(()) for _ in range(dist.get_world_size())]\n"
        "    dist.all_gather(parts, loss.detach().reshape(()))\n"
        "    return float(sum(parts) / len(parts))\n")},
    "class_counts": {"one-hot sum": (
        "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n\n\n"
        "def class_counts(labels, num_classes):\n"
        "    counts = F.one_hot(labels, num_classes).sum(dim=0).float()\n"
        "    dist.all_reduce(counts)\n    return counts.long()\n")},
    "average_gradients": {"flattened": (
        "import torch\nimport torch.distributed as dist\n\n\ndef average_gradients(model):\n"
        "    grads = [p.grad for p in model.parameters()]\n"
        "    flat = torch.cat([g.flatten() for g in grads]) / dist.get_world_size()\n"
        "    dist.all_reduce(flat)\n    i = 0\n    for g in grads:\n"
        "        g.copy_(flat[i:i + g.numel()].view_as(g))\n        i += g.numel()\n")},
    "train_epoch": {"all_gather the counts": (
        "import torch.distributed as dist\nimport torch.nn.functional as F\n\n"
        "from ddp_helpers.lessons.debugging_lab import average_gradients\n\n\n"
        "def train_epoch(model, opt, batches):\n"
        "    counts = [None] * dist.get_world_size()\n"
        "    dist.all_gather_object(counts, len(batches))\n"
        "    for x, y in batches[:min(counts)]:\n        opt.zero_grad()\n"
        "        F.mse_loss(model(x), y).backward()\n        average_gradients(model)\n"
        "        opt.step()\n")},
    "train_step": {"MAX of a flag, grads synced by hand": (
        "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n\n\n"
        "def train_step(model, opt, x, y):\n    loss = F.mse_loss(model(x), y)\n"
        "    ok = torch.tensor([int(bool(torch.isfinite(loss)))])\n"
        "    dist.all_reduce(ok, op=dist.ReduceOp.MIN)\n    if not ok.item():\n"
        "        return False\n    opt.zero_grad()\n    loss.backward()\n"
        "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n"
        "        p.grad.div_(dist.get_world_size())\n    opt.step()\n    return True\n")},
    "build": {"rank 0's weights broadcast": (
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n\n\n"
        "def build(seed):\n    torch.manual_seed(seed * 100 + dist.get_rank())\n"
        "    model = nn.Linear(4, 1)\n    for p in model.parameters():\n"
        "        dist.broadcast(p.data, src=0)\n    return model, torch.randn(8, 4)\n")},
    "sync_buffers": {"float buffers averaged": (
        "import torch.distributed as dist\n\n\ndef sync_buffers(model):\n"
        "    for b in model.buffers():\n        if b.is_floating_point():\n"
        "            dist.all_reduce(b)\n            b /= dist.get_world_size()\n")},
    "epoch_orders": {
        "seed + epoch, a new sampler each epoch": (
            "from torch.utils.data import DistributedSampler\n\n\n"
            "def epoch_orders(n, epochs, seed):\n"
            "    return [list(DistributedSampler(range(n), shuffle=True, seed=seed + e))\n"
            "            for e in range(epochs)]\n"),
        "epochs numbered from 1": edit("epoch_orders", "set_epoch(epoch)", "set_epoch(epoch + 1)")},
}


@pytest.mark.parametrize("name", sorted(WRONG_FIXES))
def test_wrong_fixes_fail_naming_the_case_and_right_ones_pass(name, tmp_path):
    wrong = WRONG_FIXES[name]
    lines = verdicts(name, {label: src for label, (src, _) in wrong.items()}, tmp_path)
    assert_all_fail(name, lines, {label: text for label, (_, text) in wrong.items()})
    assert_all_pass(name, verdicts(name, RIGHT_FIXES[name], tmp_path))
