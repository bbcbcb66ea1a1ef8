"""Lesson 12: a debugging lab. Eight broken distributed programs, each run on persistent ranks,
diagnosed with the kit's tools and fixed; the diagnosis and the fix are both checked.

The broken programs are typed in the notebook's `%%ranks` cells (short, on the page). This
module holds what they share (the data, the model, a correct gradient average) and the checks:
a diagnosis is a "prediction" (answers written in several ways are accepted: 1, "1", "rank 1");
a fix is a "file" exercise that the check launches with `dh.launch` at two world sizes (2 and 3
ranks) and compares with what the correct program does. A fix that still hangs is named by the
kit within a second (a mismatched collective) or by the launch's timeout, never waited for.
"""

from __future__ import annotations

import contextlib
import io
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from .. import clean_error_text, launch
from ..checks import Case, case
from ..exercises import exercise_check, require
from ..runtime import process_group
from ..training import average_gradients

WORLD_SIZES = (2, 3)  # every fix is checked on an even and an odd number of ranks
LAUNCH_TIMEOUT = 20  # seconds; a mismatched collective is named long before this
LR = 0.1
RTOL, ATOL = 1e-5, 1e-6  # float32 sums taken in another order: a few ulps apart at most


# ---------------------------------------------------------------- what the programs share


def regression_data(n: int = 24, bad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of 4 features and a target, the same on every rank (seeded); sample `bad`
    gets a NaN feature, the way one corrupt record in a file does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    if bad is not None:
        x[bad, 2] = float("nan")
    return x, y


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int):
    """This rank's samples: every world_size-th one, from its rank on (a strided split)."""
    return x[rank::world_size], y[rank::world_size]


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list:
    """The shard cut into batches of `size` (the last one shorter)."""
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def make_model(seed: int = 0) -> nn.Linear:
    """A Linear(4, 1), seeded: the same weights on every rank."""
    torch.manual_seed(seed)
    return nn.Linear(4, 1)


def labels(rank: int, world_size: int) -> torch.Tensor:
    """A shard of class labels 0..9 in which every label but 9 appears on every rank, and label
    9 only on rank 0 (a rare class, as in real data)."""
    common = torch.arange(9).repeat(2)
    return torch.cat([common, torch.tensor([9, 9])]) if rank == 0 else common


def one_process_update(n: int = 24) -> torch.Tensor:
    """The weight update of one SGD step (lr 0.1) on all n samples in one process."""
    x, y = regression_data(n)
    model = make_model()
    before = model.weight.detach().clone()
    F.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return (model.weight - before).detach()


def bn_model() -> nn.Sequential:
    """Linear -> BatchNorm1d -> ReLU -> Linear, seeded: the same weights on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


# ---------------------------------------------------------------- reading a diagnosis


def integer(answer) -> int | None:
    """The whole number an answer names: 4, 4.0, "4", "step 4", "rank 1"; None if it names no
    single one."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    if isinstance(answer, float) and answer.is_integer():
        return int(answer)
    if isinstance(answer, str):
        found = re.findall(r"-?\d+", answer)
        return int(found[0]) if len(found) == 1 else None
    return None


def _integer_case(label: str, answer, expected: int, what: str) -> list[Case]:
    got = integer(answer)
    if got is None:
        return [Case(label, False, f"{answer!r} names no single {what}: write it as a number, "
                                   f"e.g. {expected + 1} or \"{what} {expected + 1}\"")]
    return [Case(label, got == expected, "" if got == expected else
                 f"got {what} {got}, expected {what} {expected}")]


def _words(answer) -> str:
    return str(answer).lower().replace("-", "_") if isinstance(answer, str) else ""


# ---------------------------------------------------------------- running a learner's fix


def _failure(e: Exception) -> str:
    """A failed run in one line: what a rank raised, or the collectives that did not match."""
    if getattr(e, "exc_type", None):
        return f"rank {e.rank} raised {e.exc_type}: {(e.exc_message.splitlines() or [''])[0]}"
    return clean_error_text(str(e)).split(". The collective")[0].splitlines()[0]


class _RunFailed(Exception):
    """A launch of the learner's fix that raised or hung: its case ends that world size."""

    def __init__(self, failed: Case):
        super().__init__(failed.detail)
        self.case = failed


def _launched(label: str, runner, n: int, *args) -> list:
    """runner on n ranks: its records; a rank that raised or a hang the kit named becomes the
    failed case of this world size (raised as _RunFailed, which _per_world_size reports)."""
    try:
        return launch(runner, args=(n, *args), nprocs=n, timeout=LAUNCH_TIMEOUT, output="none")
    except Exception as e:  # noqa: BLE001 - a hang named by the kit, or a rank that raised
        raise _RunFailed(Case(label, False, _failure(e))) from e


def _per_world_size(check_one) -> list[Case]:
    """check_one(n) -> cases, for each world size; stops at the first wrong case (the verdict
    names the first one, and a second launch of a wrong fix adds only time)."""
    cases: list[Case] = []
    for n in WORLD_SIZES:
        try:
            cases += check_one(n)
        except _RunFailed as failed:
            cases.append(failed.case)
        if not all(c.ok for c in cases):
            break
    return cases


def _same_on_every_rank(label: str, values: list) -> Case:
    for r, v in enumerate(values[1:], start=1):
        c = case(label, v, values[0], rtol=0, atol=0)
        if not c.ok:
            return Case(label, False, f"rank {r} differs from rank 0: {c.detail}")
    return Case(label, True)


# ================================================================ 1. a collective one rank skips

LOG_EVERY = 5


@exercise_check("hang_step", "prediction", 0, hints=(
    "The kit stopped the ranks; `%ranks debug 0` prints what rank 0 held then.",
    "Read the locals of the frame that called dist.all_reduce."),
    diagnosis="the mismatch message names the rank in the all-reduce and its line; the "
              "snapshot (`%ranks debug 0`, or err.where[0]) holds that frame's locals, step "
              "among them.")
def check_hang_step(answer) -> list[Case]:
    """The step at which rank 0 waited: the first that logs (step % 5 == 4)."""
    return _integer_case("the step rank 0 was waiting at", answer, LOG_EVERY - 1, "step")


def _report_loss_run(rank: int, world_size: int, fn) -> dict:
    """What fn returned at each step on this rank, and what it printed (only rank 0 may)."""
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        out, printed = [], io.StringIO()
        # stderr too: a print(..., file=sys.stderr) on every rank floods the log the same way
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            for step in range(2 * LOG_EVERY):
                got = fn(torch.tensor(10.0 - step + rank), step)
                out.append(float(got) if isinstance(got, (int, float, torch.Tensor)) else got)
        return {"returns": out, "printed": printed.getvalue()}


@exercise_check("report_loss", "file", hints=(
    "Which ranks must call a collective? Which rank may print?",
    "Take the rank test off the all-reduce, keep it on the print."),
    diagnosis="a collective every rank must call sits under `if rank == 0`: the fix moves the "
              "rank test to the print alone.")
def check_report_loss(module) -> list[Case]:
    """On 2 and 3 ranks, 10 steps: every 5th step every rank gets the loss averaged over the
    ranks, other steps None, nothing hangs, and no rank but rank 0 prints."""
    fn = require(module, "report_loss")

    def one(n: int) -> list[Case]:
        label = f"{n} ranks, steps 0..9"
        runs = _launched(label, _report_loss_run, n, fn)
        mean = [10.0 - s + (n - 1) / 2 for s in range(2 * LOG_EVERY)]
        expected = [m if s % LOG_EVERY == LOG_EVERY - 1 else None for s, m in enumerate(mean)]
        cases = [_returns_case(f"{label}: what rank {r} returned", run["returns"], expected)
                 for r, run in enumerate(runs)]
        return cases + [_silent_case(f"{label}: rank {r} prints nothing (only rank 0 prints)",
                                     run["printed"]) for r, run in enumerate(runs) if r > 0]

    return _per_world_size(one)


def _silent_case(label: str, printed: str) -> Case:
    lines = printed.splitlines()
    return Case(label, not lines, f"it printed {len(lines)} line(s), the first {lines[0]!r}"
                if lines else "")


def _returns_case(label: str, got: list, expected: list) -> Case:
    """A list of numbers and Nones: the first step where got and expected part."""
    for step, (g, e) in enumerate(zip(got, expected)):
        if (g is None) != (e is None) or (e is not None and abs(g - e) > 1e-5 * abs(e)):
            return Case(label, False, f"at step {step}: got {g!r}, expected {e!r}")
    return Case(label, True)


# ================================================================ 2. a shape one rank differs in

NUM_CLASSES = 10


@exercise_check("missing_label", "prediction", 0, hints=(
    "The mismatch message names each rank's tensor: its dtype and its shape.",
    "torch.bincount(labels) has max(labels) + 1 entries."),
    diagnosis="the kit names the two shapes side by side (int64[10] against int64[9]); "
              "bincount's length is the largest label plus one, so the shorter rank never saw "
              "the last label.")
def check_missing_label(answer) -> list[Case]:
    """The label rank 1's shard lacks: 9 (its counts have 9 entries, rank 0's 10)."""
    return _integer_case("the label rank 1 never has", answer, NUM_CLASSES - 1, "label")


def _class_counts_run(rank: int, world_size: int, fn, num_classes: int) -> list:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        got = fn(_counts_labels(rank, num_classes), num_classes)
        return got.tolist() if isinstance(got, torch.Tensor) else got


def _counts_labels(rank: int, num_classes: int) -> torch.Tensor:
    # Only rank 0 has the last class; rank r has labels 0..num_classes-2, r + 1 times each.
    common = torch.arange(num_classes - 1).repeat(rank + 1)
    return torch.cat([common, torch.tensor([num_classes - 1])]) if rank == 0 else common


@exercise_check("class_counts", "file", hints=(
    "Every rank must hand the all-reduce a tensor of the same shape and dtype.",
    "torch.bincount has a `minlength` argument."),
    diagnosis="bincount's length followed each rank's data; the fix makes it follow the number "
              "of classes, which every rank knows.")
def check_class_counts(module) -> list[Case]:
    """On 2 and 3 ranks, with 10 and 7 classes, only rank 0 holding the last one: every rank
    returns the counts of each class summed over the ranks."""
    fn = require(module, "class_counts")

    def one(n: int) -> list[Case]:
        classes = NUM_CLASSES if n == 2 else 7
        label = f"{n} ranks, {classes} classes"
        runs = _launched(label, _class_counts_run, n, fn, classes)
        expected = [sum(range(1, n + 1))] * (classes - 1) + [1]
        return [case(f"{label}: rank {r}'s counts", got, expected) for r, got in enumerate(runs)]

    return _per_world_size(one)


# ================================================================ 3. gradients summed, not averaged


# a number with its "times" around it: "2x", "2.0x", "x2", "2 times", "2.0 times larger"
_FACTOR = re.compile(r"(?:x|×)?\s*(-?\d+(?:\.\d*)?)\s*(?:x|×|times)?"
                     r"(?:\s*(?:larger|bigger|as large))?")


@exercise_check("update_factor", "prediction", 1, hints=(
    "Divide one element of a rank's update by the same element of the reference's.",
    "What did all_reduce do to the gradients, and what did nobody do after it?"),
    diagnosis="hold one step against a one-process run on the whole batch: every element of "
              "the update is world_size times too large, so the gradients were summed over "
              "the ranks and never divided.")
def check_update_factor(answer) -> list[Case]:
    """How many times larger than the reference the two-rank update is: 2 (the world size)."""
    words = _words(answer).strip()
    if words in ("twice", "double", "doubled", "world_size"):
        return [Case("the factor", True)]
    times = re.fullmatch(_FACTOR, words)
    try:  # 2, 2.0, "2.0", and "2x", "2.0x", "x2", "2 times": the number, less its "times"
        got = float(times.group(1) if times else answer)
    except (TypeError, ValueError):
        got = integer(answer)
    if got is None:
        return [Case("the factor", False, f"{answer!r} is no number: write it as one, e.g. 3")]
    return [Case("the factor", abs(got - 2) < 1e-6, "" if abs(got - 2) < 1e-6 else
                 f"got {got:g}, expected 2 (the world size)")]


def _average_gradients_run(rank: int, world_size: int, fn) -> list:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        x, y = shard(*regression_data(), rank, world_size)
        model = make_model()
        F.mse_loss(model(x), y).backward()
        fn(model)
        return [p.grad.clone() for p in model.parameters()]


def _reference_grads() -> list[torch.Tensor]:
    x, y = regression_data()  # 24 samples: equal shards on 2 and 3 ranks
    model = make_model()
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


@exercise_check("average_gradients", "file", hints=(
    "all_reduce sums by default.",
    "Divide by the number of ranks, which your code can ask torch for."),
    diagnosis="compare one step with a one-process run on the whole batch; the sum over N "
              "ranks is N times the mean the reference takes.")
def check_average_gradients(module) -> list[Case]:
    """On 2 and 3 ranks, equal shards of 24 samples: every rank's gradients after the call equal
    those of one process on all 24 (the mean over the ranks)."""
    fn = require(module, "average_gradients")
    expected = _reference_grads()

    def one(n: int) -> list[Case]:
        label = f"{n} ranks"
        runs = _launched(label, _average_gradients_run, n, fn)
        return [case(f"{label}: rank {r}'s {name} gradient", got, want, rtol=RTOL, atol=ATOL)
                for r, grads in enumerate(runs)
                for name, got, want in zip(("weight", "bias"), grads, expected)]

    return _per_world_size(one)


# ================================================================ 4. a batch more on one rank


@exercise_check("extra_batch_rank", "prediction", 1, hints=(
    "Which collective is each rank in? The barrier comes after the loop.",),
    diagnosis="the kit names each rank's collective of the same number: the one in the "
              "barrier has left the loop, the one in the all-reduce still has a batch.")
def check_extra_batch_rank(answer) -> list[Case]:
    """The rank holding the extra batch: rank 0 (5 of 9 samples, 3 batches of 2 against 2)."""
    return _integer_case("the rank with the extra batch", answer, 0, "rank")


# Uneven shards: 9 samples on 2 ranks are 5 + 4 (batches of 2: 3 and 2); 11 on 3 ranks are
# 4 + 4 + 3 (batches of 3: 2, 2 and 1).
EPOCH_SAMPLES = {2: 9, 3: 11}
EPOCH_BATCH = {2: 2, 3: 3}


def _train_epoch_run(rank: int, world_size: int, fn) -> list:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        x, y = shard(*regression_data(EPOCH_SAMPLES[world_size]), rank, world_size)
        model = make_model()
        fn(model, torch.optim.SGD(model.parameters(), lr=LR),
           batches(x, y, EPOCH_BATCH[world_size]))
        return [p.detach().clone() for p in model.parameters()]


def _reference_epoch(n: int) -> list[torch.Tensor]:
    """Every rank runs the smallest batch count, gradients averaged: one process, the same sums."""
    per_rank = [batches(*shard(*regression_data(EPOCH_SAMPLES[n]), r, n), EPOCH_BATCH[n])
                for r in range(n)]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(min(len(b) for b in per_rank)):
        opt.zero_grad()
        grads = []
        for b in per_rank:
            model.zero_grad()
            F.mse_loss(model(b[step][0]), b[step][1]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(dim=0)
        opt.step()
    return [p.detach() for p in model.parameters()]


@exercise_check("train_epoch", "file", hints=(
    "A rank knows how many batches it has, not how many its peers have: ask them.",
    "all_reduce with op=dist.ReduceOp.MIN gives every rank the smallest count."),
    diagnosis="count the collectives each rank called (the kit's message numbers them): the "
              "rank with more batches makes one more all-reduce; agree on one count first.")
def check_train_epoch(module) -> list[Case]:
    """On 2 ranks (3 and 2 batches) and 3 ranks (2, 2 and 1): every rank runs the smallest
    count of averaged steps, ends with the same weights as that run in one process, and no
    collective is left without a partner."""
    fn = require(module, "train_epoch")

    def one(n: int) -> list[Case]:
        counts = [len(batches(*shard(*regression_data(EPOCH_SAMPLES[n]), r, n),
                              EPOCH_BATCH[n])) for r in range(n)]
        label = f"{n} ranks with {counts} batches"
        runs = _launched(label, _train_epoch_run, n, fn)
        expected = _reference_epoch(n)
        return [case(f"{label}: rank {r}'s {name} after the epoch", got, want, rtol=RTOL,
                     atol=ATOL)
                for r, params in enumerate(runs)
                for name, got, want in zip(("weight", "bias"), params, expected)]

    return _per_world_size(one)


# ================================================================ 5. a NaN on one rank's shard

BAD_SAMPLE = 13


@exercise_check("bad_sample", "prediction", 1, hints=(
    "Which rank's batch holds the NaN? `%ranks debug R --commands 'p xb'` on each.",
    "Rank r's shard is x[r::world_size]; batch k of 2 holds its samples 2k and 2k + 1."),
    diagnosis="post-mortem on each rank shows the same non-finite weights (the all-reduce "
              "spread the NaN), but a non-finite loss and a NaN in the batch on one rank only; "
              "its step and row give the sample's index.")
def check_bad_sample(answer) -> list[Case]:
    """The index of the corrupt sample in the whole dataset: 13 (rank 1's step 3, row 0)."""
    return _integer_case("the index of the bad sample", answer, BAD_SAMPLE, "sample")


def _train_step_run(rank: int, world_size: int, fn, bad_rank: int) -> dict:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        model, opt, steps = make_model(), None, []
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = shard(*regression_data(8 * world_size), rank, world_size)
        for step, (xb, yb) in enumerate(batches(x, y, 2)):
            if rank == bad_rank and step == 1:
                xb = xb.clone()
                xb[0, 1] = float("nan")
            steps.append(fn(model, opt, xb, yb))
        return {"stepped": steps, "params": [p.detach().clone() for p in model.parameters()]}


def _reference_skipping(n: int) -> list[torch.Tensor]:
    per_rank = [batches(*shard(*regression_data(8 * n), r, n), 2) for r in range(n)]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(4):
        if step == 1:
            continue  # the step a rank's batch is bad: skipped on every rank
        grads = []
        for b in per_rank:
            model.zero_grad()
            F.mse_loss(model(b[step][0]), b[step][1]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(dim=0)
        opt.step()
    return [p.detach() for p in model.parameters()]


@exercise_check("train_step", "file", hints=(
    "The rank with the bad batch knows; the others do not. How can they all learn it?",
    "all_reduce a flag (1.0 when the loss is not finite) before the gradients, and skip "
    "together."),
    diagnosis="a non-finite loss on one rank becomes non-finite weights on every rank after "
              "the gradient all-reduce; the ranks must agree to skip, as torch's GradScaler "
              "skips a step when it finds an inf.")
def check_train_step(module) -> list[Case]:
    """On 2 and 3 ranks, 4 steps, a NaN in the last rank's batch at step 1: every rank returns
    [True, False, True, True] and ends with the weights of those three steps in one process."""
    fn = require(module, "train_step")

    def one(n: int) -> list[Case]:
        label = f"{n} ranks, a NaN on rank {n - 1} at step 1"
        runs = _launched(label, _train_step_run, n, fn, n - 1)
        expected = _reference_skipping(n)
        cases = [case(f"{label}: what rank {r} returned at steps 0..3", run["stepped"],
                      [True, False, True, True]) for r, run in enumerate(runs)]
        cases += [case(f"{label}: rank {r}'s {name} after 4 steps", got, want, rtol=RTOL,
                       atol=ATOL)
                  for r, run in enumerate(runs)
                  for name, got, want in zip(("weight", "bias"), run["params"], expected)]
        return cases

    return _per_world_size(one)


# ================================================================ 6. seeds: agree or differ


_DATA = re.compile(r"\b(x|data|batch|input)\b")
_NEGATED = re.compile(r"\b(not|no|never)\b|n't")
# a clause naming the data as what may differ ("the data x should differ", "x may differ")
_EXCUSED = re.compile(r"\b(differ\w*|may|own|allowed|fine|ok|expected|not|no|never)\b|n't")


def _names_model(clause: str) -> bool:
    return any(w in clause for w in ("model", "weight", "param", "init", "bias", "linear"))


@exercise_check("seed_differs", "prediction", "x", hints=(
    "`%ranks compare model x` lists what differs; which of those should?",),
    diagnosis="compare lists both the weights and the data as different; data should differ "
              "(each rank its own shard), weights must not: they were drawn after a seed that "
              "depends on the rank, and averaging gradients never closes that gap.")
def check_seed_differs(answer) -> list[Case]:
    """What differs across ranks but must not: the model's weights (the data may)."""
    clauses = re.split(r"[;,()]|\bbut\b", _words(answer))
    right = any(_names_model(c) and (not _NEGATED.search(c) or _DATA.search(c))
                for c in clauses)
    wrong = any(_DATA.search(c) and not _EXCUSED.search(c) for c in clauses)
    if right and not wrong:
        return [Case("what must be the same on every rank", True)]
    return [Case("what must be the same on every rank", False,
                 f"got {answer!r}: " + ("the data should differ: each rank trains on its own"
                                        if wrong else "name one of the values compared"))]


def _build_run(rank: int, world_size: int, fn, seed: int) -> dict:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        model, x = fn(seed)
        return {"params": [p.detach().clone() for p in model.parameters()], "x": x.clone()}


@exercise_check("build", "file", hints=(
    "Two things, two wishes: one must be equal everywhere, one different everywhere.",
    "Seed once for the model (the same seed on every rank), then once per rank for the data; "
    "or broadcast rank 0's weights."),
    diagnosis="`%ranks compare` after building: a model's weights must be the same bytes on "
              "every rank before the first step (DDP broadcasts rank 0's when it wraps); a "
              "rank's data must not be.")
def check_build(module) -> list[Case]:
    """On 2 and 3 ranks, seeds 0 and 7: the model is the same on every rank, each rank's x is
    its own (no two ranks equal)."""
    fn = require(module, "build")

    def one(n: int) -> list[Case]:
        seed = 0 if n == 2 else 7
        label = f"{n} ranks, seed {seed}"
        runs = _launched(label, _build_run, n, fn, seed)
        cases = [_same_on_every_rank(f"{label}: the model's {name}", [r["params"][i]
                                                                      for r in runs])
                 for i, name in enumerate(("weight", "bias"))]
        for a in range(n):
            for b in range(a + 1, n):
                same = torch.equal(runs[a]["x"], runs[b]["x"])
                cases.append(Case(f"{label}: x on ranks {a} and {b}", not same,
                                  f"rank {a} and rank {b} hold the same data" if same else ""))
        return cases

    return _per_world_size(one)


# ================================================================ 7. a buffer nobody synchronises


@exercise_check("drifting_buffer", "prediction", "model.1.weight", hints=(
    "`%ranks compare model` after training: read the column 'same on every rank'.",),
    diagnosis="the gradients were averaged, so every parameter agrees; BatchNorm's running "
              "statistics are buffers, computed from each rank's own batches and never sent.")
def check_drifting_buffer(answer) -> list[Case]:
    """The first entry that differs: model.1.running_mean (running_var too; not a weight)."""
    words = _words(answer)
    right = any(w in words for w in ("running_mean", "running_var", "running mean",
                                     "running var", "buffer", "statistic"))
    if "num_batches_tracked" in words:  # a buffer too, but it counts batches: equal everywhere
        return [Case("the entry that differs", False,
                     f"got {answer!r}: num_batches_tracked counts the batches, the same number "
                     "on every rank; look at the statistics BatchNorm keeps")]
    if right:
        return [Case("the entry that differs", True)]
    return [Case("the entry that differs", False,
                 f"got {answer!r}: that one is the same on every rank")]


def _sync_buffers_run(rank: int, world_size: int, fn) -> list:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        model = bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = shard(*regression_data(8 * world_size), rank, world_size)
        for xb, yb in batches(x, y, 4):
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            average_gradients(model)
            opt.step()
            if fn is not None:
                fn(model)
        bn = model[1]
        return [bn.running_mean.clone(), bn.running_var.clone()]


@exercise_check("sync_buffers", "file", hints=(
    "model.buffers() lists them; which collective makes them equal?",
    "DDP broadcasts rank 0's buffers before each forward; averaging them is the other choice."),
    diagnosis="`%ranks compare model` names every entry that differs: parameters are averaged "
              "through their gradients, buffers need a collective of their own.")
def check_sync_buffers(module) -> list[Case]:
    """On 2 and 3 ranks, called after each of 2 steps: every rank ends with the same running
    statistics, equal to rank 0's own (a broadcast, as DDP does) or to the mean over ranks."""
    fn = require(module, "sync_buffers")

    def one(n: int) -> list[Case]:
        label = f"{n} ranks, 2 steps"
        runs = _launched(label, _sync_buffers_run, n, fn)
        unsynced = _launched(label, _sync_buffers_run, n, None)
        cases = [_same_on_every_rank(f"{label}: BatchNorm's {name}", [r[i] for r in runs])
                 for i, name in enumerate(("running_mean", "running_var"))]
        if not all(c.ok for c in cases):
            return cases
        for i, name in enumerate(("running_mean", "running_var")):
            mean = torch.stack([u[i] for u in unsynced]).mean(dim=0)
            as_rank0 = case("", runs[0][i], unsynced[0][i], rtol=RTOL, atol=ATOL)
            as_mean = case(f"{label}: BatchNorm's {name} (expected the mean over the ranks, or "
                           "rank 0's)", runs[0][i], mean, rtol=RTOL, atol=ATOL)
            cases.append(as_rank0 if as_rank0.ok else as_mean)
        return cases

    return _per_world_size(one)


# ================================================================ 8. set_epoch forgotten


@exercise_check("distinct_orders", "prediction", 3, hints=(
    "Print `orders` on rank 0, or compare its three epochs.",),
    diagnosis="DistributedSampler shuffles with the seed plus its epoch, and the epoch stays 0 "
              "until set_epoch is called: every epoch comes out in the same order.")
def check_distinct_orders(answer) -> list[Case]:
    """How many different orders rank 0 saw in 3 epochs: 1."""
    if _words(answer).strip() in ("one", "a single one", "the same"):
        return [Case("orders rank 0 saw", True)]
    return _integer_case("orders rank 0 saw", answer, 1, "order")


def _epoch_orders_run(rank: int, world_size: int, fn, n: int, epochs: int, seed: int) -> list:
    with process_group(rank, world_size, verbose=False, timeout_s=LAUNCH_TIMEOUT):
        got = fn(n, epochs, seed)
        return [list(map(int, o)) for o in got] if isinstance(got, (list, tuple)) else got


EPOCH_NUMBERS = 100  # the epoch numbers an answer's set_epoch may have used: 0, 1, ... 99


def _sampler_orders(n: int, seed: int, epoch: int, world_size: int) -> list[list[int]]:
    """Every rank's indices in DistributedSampler's shuffle of range(n) at epoch `epoch`."""
    orders = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def _epoch_numbers(runs: list, n: int, seed: int, world_size: int, epochs: int) -> list:
    """For each epoch, the epoch number at which torch's sampler gives every rank the indices
    it returned (None where none does): set_epoch(epoch + 1) is as right as set_epoch(epoch)."""
    shuffles = [_sampler_orders(n, seed, k, world_size) for k in range(EPOCH_NUMBERS)]
    numbers = []
    for e in range(epochs):
        got = [run[e] if isinstance(run, list) and len(run) > e else None for run in runs]
        numbers.append(next((k for k, orders in enumerate(shuffles) if orders == got), None))
    return numbers


@exercise_check("epoch_orders", "file", hints=(
    "The sampler must be told which epoch it is, before each epoch's pass.",),
    diagnosis="print each epoch's indices on the ranks: the same list every epoch means the "
              "sampler's epoch never moved.")
def check_epoch_orders(module) -> list[Case]:
    """On 2 ranks (10 samples, seed 0) and 3 ranks (11 samples, seed 5), 3 epochs: each epoch,
    every rank's indices are DistributedSampler's at one epoch number (any first number: 0 as
    torch's examples, or 1), a different number each epoch."""
    fn = require(module, "epoch_orders")

    def one(n: int) -> list[Case]:
        samples, seed = (10, 0) if n == 2 else (11, 5)
        label = f"{n} ranks, {samples} samples, seed {seed}"
        runs = _launched(label, _epoch_orders_run, n, fn, samples, 3, seed)
        numbers = _epoch_numbers(runs, samples, seed, n, 3)
        first = numbers[0] if numbers[0] is not None else 0
        wanted = [k if k is not None else first + e for e, k in enumerate(numbers)]
        shuffles = [_sampler_orders(samples, seed, k, n) for k in wanted]
        cases = [case(f"{label}: rank {r}'s indices, epochs 0..2", got,
                      [orders[r] for orders in shuffles]) for r, got in enumerate(runs)]
        found = [k for k in numbers if k is not None]
        new_each = len(set(found)) == len(found)
        cases.append(Case(f"{label}: a new order each epoch", new_each, "" if new_each else
                          f"the 3 epochs are the sampler's shuffles at epoch numbers "
                          f"{', '.join(map(str, numbers))}: an epoch repeated an earlier "
                          f"one's order (set_epoch must change before each epoch)"))
        return cases

    return _per_world_size(one)
