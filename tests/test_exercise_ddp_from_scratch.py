"""Lesson 09's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS, on 3 ranks (the batch of 16 does not divide; a world size hard-coded as 2 is
wrong). Each is also checked on the Ledger, one watched step on a model with 5 gradients and 2
frozen tensors: one all_reduce of each gradient (naive, overlapped), one of all of them
flattened (flat), one per bucket in backward's order (bucketed), and for overlapped and bucketed
each all_reduce started in backward by the hook of the gradient that completes it, still in
flight when backward returns (ranks 1 and 2 finish backward before rank 0 starts its own)."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh
from ddp_helpers import exercises

ODD = "one step (5 gradients, 2 frozen tensors)"
FIRST_GRAD = "gradient of embed.weight after"


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(3, output="none", timeout=60) as p:
        yield p


def check(name, wrong, right, pool, tmp_path):
    """Every wrong answer FAILs naming its case; the kit's solution and the right ones PASS."""
    lines = verdicts(name, {k: src for k, (src, _) in wrong.items()}, tmp_path, pool)
    assert_all_fail(name, lines, {k: named for k, (_, named) in wrong.items()})
    assert_all_pass(name, verdicts(name, {"the kit's": exercises.solution_source(name), **right},
                                   tmp_path, pool))


# ---------------------------------------------------------------- naive_ddp

MEAN = "        p.grad /= dist.get_world_size()  # ... made into the mean"
NAIVE_FLAT = (  # flat_ddp's answer given as the naive one: right values, one call
    "        pass\n    grads = [p.grad for p in model.parameters() if p.grad is not None]\n"
    "    flat = torch.cat([g.reshape(-1) for g in grads])\n    ar(flat)\n"
    "    flat /= dist.get_world_size()\n    offset = 0\n    for g in grads:\n"
    "        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n        offset += g.numel()")
NAIVE_WRONG = {  # label: (answer, text its FAIL must name)
    "the sum, not the mean": (edit("naive_ddp", MEAN, "        pass"),
                              f"{ODD}: {FIRST_GRAD} naive_average: at index"),
    "async_op=True, never waited": (  # the race made certain: rank 0 joins after the others
        edit("naive_ddp", "dist.all_reduce(p.grad)", "dist.all_reduce(p.grad, async_op=True)"),
        "after naive_average: at index"),
    "divided by 2, the notebook's world size": (
        edit("naive_ddp", MEAN, "        p.grad /= 2"), f"{ODD}: {FIRST_GRAD} naive_average"),
    "the parameters averaged, not the gradients": (
        edit("naive_ddp", "dist.all_reduce(p.grad)  # the sum over the ranks ...\n"
             "        p.grad /=", "dist.all_reduce(p.data)\n        p.data /="),
        f"{ODD}: {FIRST_GRAD} naive_average: at index"),
    "stops at the first missing gradient": (
        edit("naive_ddp", "            continue", "            break"),
        f"{ODD}: gradient of body.0.0.weight after naive_average"),
    "the frozen parameter not broadcast": (
        edit("naive_ddp", "for p in model.parameters():  # each tensor once",
             "for p in [q for q in model.parameters() if q.requires_grad]:  #"),
        "rank 0: parameters after broadcast_parameters, every rank's (rank, index), against "
        "rank 0's initial ones: at index (1, 512)"),
    "broadcast from the last rank": (
        edit("naive_ddp", "src=0", "src=dist.get_world_size() - 1"),
        "rank 0: parameters after broadcast_parameters, every rank's (rank, index), against "
        "rank 0's initial ones: at index (0, 0)"),
    "the modules walked, so the tied weight twice": (
        edit("naive_ddp", "    for p in model.parameters():\n        if p.grad is None",
             "    for p in [q for m in model.modules() for q in m.parameters(recurse=False)]:\n"
             "        if p.grad is None"),
        f"{ODD}: collectives: called all_reduce #1 float32[32, 16]"),
    "one flat all_reduce (flat_ddp's answer), imported under an alias": (
        edit("naive_ddp", "        if p.grad is None:  # frozen (requires_grad=False) or unused: "
             "nothing to average\n            continue\n        dist.all_reduce(p.grad)  # the "
             "sum over the ranks ...\n" + MEAN, NAIVE_FLAT).replace(
            "import torch.distributed as dist\n",
            "import torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"),
        f"{ODD}: collectives: called all_reduce #1 float32[1056]; expected one all_reduce of "
        "each of the 5 gradients"),
}

NAIVE_RIGHT = {
    "aliased imports, last parameter first, requires_grad tested, div_": (
        "import torch\nfrom torch.distributed import all_reduce as ar, broadcast as bc\n"
        "from torch.distributed import get_world_size\n\n\n"
        "def broadcast_parameters(model):\n    with torch.no_grad():\n"
        "        for p in reversed(list(model.parameters())):\n            bc(p, 0)\n\n\n"
        "def naive_average(model):\n    for p in reversed(list(model.parameters())):\n"
        "        if not p.requires_grad:\n            continue\n        ar(p.grad)\n"
        "        p.grad.div_(get_world_size())\n"),
    "one flat broadcast, each gradient divided first": (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.nn.utils import parameters_to_vector, vector_to_parameters\n\n\n"
        "def broadcast_parameters(model):\n    with torch.no_grad():\n"
        "        flat = parameters_to_vector(model.parameters())\n"
        "        dist.broadcast(flat, src=0)\n"
        "        vector_to_parameters(flat, model.parameters())\n\n\n"
        "def naive_average(model):\n    n = dist.get_world_size()\n"
        "    for grad in [p.grad for p in model.parameters() if p.grad is not None]:\n"
        "        grad /= n\n        dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n"),
}


def test_naive_ddp(pool, tmp_path):
    check("naive_ddp", NAIVE_WRONG, NAIVE_RIGHT, pool, tmp_path)


# ---------------------------------------------------------------- flat_ddp

FLAT_GRADS = "grads = [p.grad for p in model.parameters() if p.grad is not None]"
FLAT_WRONG = {
    "the sum, not the mean": (edit("flat_ddp", "flat /= dist.get_world_size()", "pass"),
                              f"{ODD}: {FIRST_GRAD} flat_average: at index"),
    "async_op=True, never waited": (
        edit("flat_ddp", "dist.all_reduce(flat)", "dist.all_reduce(flat, async_op=True)"),
        "after flat_average: at index"),
    "divided by 2": (edit("flat_ddp", "flat /= dist.get_world_size()", "flat /= 2"),
                     f"{ODD}: {FIRST_GRAD} flat_average"),
    "the mean never copied back": (edit("flat_ddp", "g.copy_(", "g.clone().copy_("),
                                   f"{ODD}: {FIRST_GRAD} flat_average: at index"),
    "copied back in the wrong order": (
        edit("flat_ddp", "    for g in grads:  #", "    for g in grads[::-1]:  #"),
        f"{ODD}: gradient of "),
    "zeros sent for the frozen tensors": (
        edit("flat_ddp", FLAT_GRADS, "grads = [p.grad if p.grad is not None else "
             "torch.zeros_like(p) for p in model.parameters()]"),
        f"{ODD}: collectives: called all_reduce #1 float32[1328]; expected one all_reduce of "
        "float32[1056]"),
    "one all_reduce per gradient": (
        edit("flat_ddp", "    flat = torch.cat(", "    for g in grads:\n"
             "        dist.all_reduce(g)\n        g /= dist.get_world_size()\n"
             "    return\n    flat = torch.cat("),
        f"{ODD}: collectives: called all_reduce #1 float32[32, 16], all_reduce #2"),
    "the parameters flattened, not the gradients": (
        edit("flat_ddp", FLAT_GRADS,
             "grads = [p.data for p in model.parameters() if p.grad is not None]"),
        f"{ODD}: {FIRST_GRAD} flat_average: at index"),
}

FLAT_RIGHT = {
    "torch's flatten helpers under an alias, divided first": (
        "from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors\n"
        "from torch.distributed import all_reduce as ar, get_world_size\n\n\n"
        "def flat_average(model):\n"
        "    grads = [p.grad for p in model.parameters() if p.requires_grad]\n"
        "    flat = _flatten_dense_tensors(grads).div_(get_world_size())\n    ar(flat)\n"
        "    for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):\n"
        "        g.copy_(mean)\n"),
    "one buffer filled slice by slice, split back": (
        "import torch\nimport torch.distributed as dist\n\n\ndef flat_average(model):\n"
        "    grads = [p.grad for p in model.parameters() if p.grad is not None]\n"
        "    sizes = [g.numel() for g in grads]\n    flat = torch.empty(sum(sizes))\n"
        "    for part, g in zip(flat.split(sizes), grads):\n        part.copy_(g.flatten())\n"
        "    dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True).wait()\n"
        "    for part, g in zip(flat.split(sizes), grads):\n"
        "        g.copy_(part.view_as(g) / dist.get_world_size())\n"),
}


def test_flat_ddp(pool, tmp_path):
    check("flat_ddp", FLAT_WRONG, FLAT_RIGHT, pool, tmp_path)


# ---------------------------------------------------------------- overlapped_ddp

STARTED = f"{ODD}: one all_reduce per gradient started as backward made the gradients"
LAUNCH = "        pending.append((p, dist.all_reduce(p.grad, async_op=True)))"
OVERLAP_WRONG = {
    "the sum, not the mean": (edit("overlapped_ddp", "p.grad /= dist.get_world_size()", "pass"),
                              f"{ODD}: {FIRST_GRAD} finish_overlap: at index"),
    "divided by 2": (edit("overlapped_ddp", "p.grad /= dist.get_world_size()", "p.grad /= 2"),
                     f"{ODD}: {FIRST_GRAD} finish_overlap"),
    "the hooks note the gradient, the all_reduce after backward": (
        edit("overlapped_ddp", LAUNCH, "        pending.append((p, None))").replace(
            "        work.wait()\n", "        dist.all_reduce(p.grad)\n"),
        f"{STARTED}: 0 of the 5 collectives were called before backward returned"),
    "a blocking all_reduce in the hook": (
        edit("overlapped_ddp", LAUNCH, "        work = dist.all_reduce(p.grad, async_op=True)\n"
             "        work.wait()  # the hook waits: backward stops until every rank is here\n"
             "        pending.append((p, work))"),
        f"rank 0: {ODD}: the other ranks' backward returned before rank 0 began its own: "
        "rank 0 waited 10 s"),
    "every all_reduce started by the last gradient's hook": (
        edit("overlapped_ddp", LAUNCH, "        ready.append(p)\n"
             "        if len(ready) == len(hooked):  # the end of backward: no overlap\n"
             "            for q in ready:\n"
             "                pending.append((q, dist.all_reduce(q.grad, async_op=True)))\n"
             "            ready.clear()").replace(
            "    pending = []\n", "    pending, ready = [], []\n"
            "    hooked = [p for p in model.parameters() if p.requires_grad]\n"),
        f"{STARTED}: 5 of the 5 collectives were called before backward returned (expected 5: "
        "one all_reduce per gradient, each from a hook); all_reduce #1 was called once 4 of 5 "
        "gradients were ready, expected by the time 1 were"),
    "never waits: divides while the sum is still in flight": (
        edit("overlapped_ddp", "        work.wait()\n", ""), f"{ODD}: gradient of "),
    "the list never emptied, so step 2 divides the old works again": (
        edit("overlapped_ddp", "pending.clear()", "pass"),
        "parameters after 3 steps, against torch's DDP: at index"),
    "every parameter hooked, the frozen ones too": (
        edit("overlapped_ddp", "if p.requires_grad:", "if True:"),
        f"{ODD}: your functions raised RuntimeError: cannot register a hook on a tensor that "
        "doesn't require gradient"),
}

OVERLAP_RIGHT = {
    "aliased import, divided in the hook, a dict of works": (
        "from torch.distributed import all_reduce as ar, get_world_size\n\n\n"
        "def attach_overlap_hooks(model):\n    works = {}\n\n    def hook(p):\n"
        "        p.grad.div_(get_world_size())  # the mean of the parts is the mean\n"
        "        works[p] = ar(p.grad, async_op=True)\n\n"
        "    for p in model.parameters():\n        if p.requires_grad:\n"
        "            p.register_post_accumulate_grad_hook(hook)\n    return works\n\n\n"
        "def finish_overlap(works):\n    for work in works.values():\n        work.wait()\n"
        "    works.clear()\n"),
    "hooks on the AccumulateGrad nodes, as DDP's reducer sets them": (
        "import torch.distributed as dist\n\n\ndef attach_overlap_hooks(model):\n"
        "    state = {'works': [], 'nodes': []}\n    for p in model.parameters():\n"
        "        if not p.requires_grad:\n            continue\n"
        "        node = p.view_as(p).grad_fn.next_functions[0][0]\n\n"
        "        def hook(*_, p=p):\n"
        "            state['works'].append((p, dist.all_reduce(p.grad, async_op=True)))\n\n"
        "        node.register_hook(hook)\n"
        "        state['nodes'].append(node)  # kept alive, as DDP keeps its grad accumulators\n"
        "    return state\n\n\ndef finish_overlap(state):\n"
        "    for p, work in state['works']:\n        work.get_future().wait()\n"
        "        p.grad.div_(dist.get_world_size())\n    state['works'].clear()\n"),
}


def test_overlapped_ddp(pool, tmp_path):
    check("overlapped_ddp", OVERLAP_WRONG, OVERLAP_RIGHT, pool, tmp_path)


# ---------------------------------------------------------------- bucketed_ddp

TRAINABLE = "[p for p in model.parameters() if p.requires_grad]"
BUCKET_STARTED = (f"{ODD}, buckets of 1088 B: one all_reduce per bucket started as backward "
                  "made the gradients")
BUCKET_LAUNCH = ("            pending.append((buckets[i], flat, dist.all_reduce(flat, "
                 "async_op=True)))")
BUCKET_WRONG = {
    "never waits: copies each bucket back while its sum is in flight": (
        edit("bucketed_ddp", "        work.wait()\n        flat /=", "        flat /="),
        f"{ODD}, buckets of 1088 B: gradient of "),
    "the sum, not the mean": (edit("bucketed_ddp", "flat /= dist.get_world_size()", "pass"),
                              f"{ODD}, buckets of 1088 B: {FIRST_GRAD} finish_buckets"),
    "divided by 2": (edit("bucketed_ddp", "flat /= dist.get_world_size()", "flat /= 2"),
                     f"{ODD}, buckets of 1088 B: {FIRST_GRAD} finish_buckets"),
    "buckets in forward order": (
        edit("bucketed_ddp", f"reversed({TRAINABLE})", TRAINABLE),
        "make_buckets(model, 0.002), parameter names: got [['embed.weight', 'frozen.bias'], "),
    "a bucket closed only above the cap": (
        edit("bucketed_ddp", "if size >= bucket_mb", "if size > bucket_mb"),
        "make_buckets(model, 1088 B (a bucket holds the cap exactly)), parameter names"),
    "MB taken for MiB": (
        edit("bucketed_ddp", "bucket_mb * 2**20", "bucket_mb * 1e6"),
        "make_buckets(model, 1089 B (one byte above a bucket)), parameter names"),
    "the last, part-filled bucket dropped": (
        edit("bucketed_ddp", "    if current:\n        buckets.append(current)\n", ""),
        "make_buckets(model, 1), parameter names"),
    "the frozen tensors bucketed too": (
        edit("bucketed_ddp", TRAINABLE, "list(model.parameters())"),
        "make_buckets(model, 0.002), parameter names"),
    "the mean never copied back": (
        edit("bucketed_ddp", "p.grad.copy_(", "p.grad.clone().copy_("),
        f"{ODD}, buckets of 1088 B: {FIRST_GRAD} finish_buckets: at index"),
    "every bucket all-reduced after backward": (
        edit("bucketed_ddp", BUCKET_LAUNCH,
             "            pending.append((buckets[i], flat, None))").replace(
            "        work.wait()\n", "        dist.all_reduce(flat)\n"),
        f"{BUCKET_STARTED}: 0 of the 3 collectives were called before backward returned"),
    "a blocking all_reduce in the hook": (
        edit("bucketed_ddp", BUCKET_LAUNCH, "            work = dist.all_reduce(flat, "
             "async_op=True)\n            work.wait()  # backward waits for every rank here\n"
             "            pending.append((buckets[i], flat, work))"),
        f"rank 0: {ODD}, buckets of 1088 B: the other ranks' backward returned before rank 0 "
        "began its own: rank 0 waited 10 s"),
    "the ready count never reset, so step 2 sends nothing": (
        edit("bucketed_ddp", "            ready[i] = 0  # for the next backward\n", ""),
        "parameters after 3 steps, against torch's DDP: at index"),
}

BUCKET_RIGHT = {
    "a running total, ids counted in a set, torch's flatten helpers under an alias": (
        "from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors\n"
        "from torch.distributed import all_reduce as ar, get_world_size\n\n\n"
        "def make_buckets(model, bucket_mb):\n"
        "    params = [p for p in model.parameters() if p.requires_grad][::-1]\n"
        "    cap, buckets, start, total = bucket_mb * 1024 * 1024, [], 0, 0\n"
        "    for i, p in enumerate(params):\n        total += p.numel() * p.element_size()\n"
        "        if total >= cap or i == len(params) - 1:\n"
        "            buckets.append(params[start:i + 1])\n            start, total = i + 1, 0\n"
        "    return buckets\n\n\ndef attach_bucket_hooks(model, buckets):\n"
        "    works, seen = {}, [set() for _ in buckets]\n\n    def hook(p):\n"
        "        i = next(k for k, b in enumerate(buckets) if any(q is p for q in b))\n"
        "        seen[i].add(id(p))\n        if len(seen[i]) == len(buckets[i]):\n"
        "            seen[i].clear()\n"
        "            flat = _flatten_dense_tensors([q.grad for q in buckets[i]])\n"
        "            flat /= get_world_size()\n"
        "            works[i] = (buckets[i], flat, ar(flat, async_op=True))\n\n"
        "    for b in buckets:\n        for p in b:\n"
        "            p.register_post_accumulate_grad_hook(hook)\n    return works\n\n\n"
        "def finish_buckets(works):\n    for i in sorted(works):\n"
        "        bucket, flat, work = works[i]\n        work.wait()\n"
        "        grads = [p.grad for p in bucket]\n"
        "        for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):\n"
        "            g.copy_(mean)\n    works.clear()\n"),
    "the kit's, copied back with torch.split and a future": edit(
        "bucketed_ddp",
        "        work.wait()\n        flat /= dist.get_world_size()\n        offset = 0\n"
        "        for p in bucket:\n"
        "            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))\n"
        "            offset += p.numel()\n",
        "        work.get_future().wait()\n"
        "        parts = flat.div(dist.get_world_size()).split([p.numel() for p in bucket])\n"
        "        for p, part in zip(bucket, parts):\n            p.grad.copy_(part.view_as(p))\n"),
}


def test_bucketed_ddp(pool, tmp_path):
    check("bucketed_ddp", BUCKET_WRONG, BUCKET_RIGHT, pool, tmp_path)
