"""Lesson 09: DistributedDataParallel rebuilt by hand, in four versions, each held against torch.

The notebook runs these on persistent ranks (`%%ranks`): a version is the learner's functions
(or, until they are written, the kit's solution), trained for a few steps next to torch's DDP
and a single process on the whole batch, with its collectives counted by the Ledger (calls, bytes).
Everything returned to the parent is plain data (lists, dicts, floats, CPU tensors).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checks import Case, case
from ..collectives import collective_bytes
from ..data import rank_share
from ..exercises import NotAttempted, exercise_check, require, solution_module
from ..models import flat_params
from ..races import agreed_key, others_said, rank_zero_last, say
from ..runtime import device_ids
from ..timing import Timer

STEPS, LR, BATCH, SEQ = 3, 0.5, 16, 6
RTOL, ATOL = 1e-5, 1e-6  # float32 sums taken in another order: a few ulps apart at most
SMALL = {"vocab": 32, "width": 16, "depth": 2}  # checks: 7 parameters, 6 with gradients
LARGE = {"vocab": 1024, "width": 256, "depth": 6}  # timing: 14 gradients, 2.5 MiB
LARGE_BATCH = 64
TIMED = ("none", "naive", "flat", "overlapped", "bucketed", "ddp")
# Caps that give the large model 14, 7, 4, 3, 2 and 1 buckets (a layer is 257 KiB).
SWEEP_CAPS_MB = (0.0005, 0.25, 0.5, 0.75, 1.0, 4.0)
SWEEP_BUCKETS = [14, 7, 4, 3, 2, 1]
AR_SIZES = [4**k for k in range(1, 12)]  # 4 B .. 4 MiB, for alpha and B


# ---------------------------------------------------------------- the model and its data


class TiedNet(nn.Module):
    """Embedding -> mean over the sequence -> frozen projection -> MLP -> head tied to the
    embedding: one tensor used twice, and one that never gets a gradient."""

    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.weight.requires_grad_(False)  # e.g. a pretrained projection kept fixed
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(depth)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two uses, one gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens).mean(dim=1)))
        return self.head(self.body(h))


def tied_model(seed: int = 0, vocab: int = 32, width: int = 16, depth: int = 2) -> TiedNet:
    """A TiedNet whose initial weights depend only on `seed`."""
    torch.manual_seed(seed)
    return TiedNet(vocab, width, depth)


def global_batch(step: int, size: int = BATCH, vocab: int = 32) -> tuple[torch.Tensor, ...]:
    """Step `step`'s whole batch: token sequences and the token to predict (any rank can make
    it: it depends only on `step`)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (size, SEQ), generator=g),
            torch.randint(0, vocab, (size,), generator=g))


def rank_batch(step: int, rank: int, world_size: int, device: torch.device,
               size: int = BATCH, vocab: int = 32) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s equal share of step `step`'s batch, on its device."""
    return rank_share(global_batch(step, size, vocab), rank, world_size, device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: the mean of equal shards' means is the whole batch's mean."""
    return F.cross_entropy(logits, target)


def gradient_bytes(params) -> int:
    """Bytes of the gradients of these parameters (those that need one)."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


# ---------------------------------------------------------------- versions of DDP


@dataclass
class Version:
    """One way to keep replicas in sync: setup(model) -> (module to call, state) once, then
    sync(state) after each backward, before the optimizer step."""

    name: str
    setup: Callable[[nn.Module], tuple[nn.Module, object]]
    sync: Callable[[object], None]
    source: str = "the kit's solution"


EXERCISES = {"naive": "naive_ddp", "flat": "flat_ddp", "overlapped": "overlapped_ddp",
             "bucketed": "bucketed_ddp"}
FUNCTIONS = {"naive_ddp": ("broadcast_parameters", "naive_average"),
             "flat_ddp": ("flat_average",),
             "overlapped_ddp": ("attach_overlap_hooks", "finish_overlap"),
             "bucketed_ddp": ("make_buckets", "attach_bucket_hooks", "finish_buckets")}


def _functions(exercise: str, namespace: dict | None) -> tuple[dict, str]:
    """The learner's functions for `exercise` if all are written, else the kit's solution."""
    names = FUNCTIONS[exercise]
    try:
        found = require(namespace or {}, *names)
        return dict(zip(names, found if len(names) > 1 else [found])), "yours"
    except NotAttempted:  # not written yet (or still the template): the kit's answer
        pass
    solution = solution_module(exercise)
    return {n: getattr(solution, n) for n in names}, "the kit's solution"


def make_version(name: str, namespace: dict | None = None, bucket_mb: float = 0.5,
                 broadcast: bool = True) -> Version:
    """Version `name` ("naive", "flat", "overlapped", "bucketed" or "ddp") built from the
    learner's functions in `namespace` where they are written, else from the kit's solutions.
    broadcast=False skips the initial broadcast (for replicas that start equal)."""
    if name == "none":  # no communication at all: the compute-only baseline for timing
        return Version("none", lambda m: (m, None), lambda state: None, "no synchronisation")
    if name == "ddp":
        return Version("ddp", lambda m: (DDP(m, device_ids=device_ids(_device_of(m)),
                                             bucket_cap_mb=bucket_mb), None),
                       lambda state: None, "torch's DistributedDataParallel")
    fns, source = _functions(EXERCISES[name], namespace)
    start, _ = _functions("naive_ddp", namespace) if broadcast else ({}, "")
    return _build(name, fns, start.get("broadcast_parameters"), bucket_mb, source)


def _build(name: str, fns: dict, broadcast, bucket_mb: float, source: str) -> Version:
    def setup(model: nn.Module):
        if broadcast is not None:
            broadcast(model)
        if name == "overlapped":
            return model, fns["attach_overlap_hooks"](model)
        if name == "bucketed":
            buckets = fns["make_buckets"](model, bucket_mb)
            return model, fns["attach_bucket_hooks"](model, buckets)
        return model, model

    sync = {"naive": fns.get("naive_average"), "flat": fns.get("flat_average"),
            "overlapped": fns.get("finish_overlap"), "bucketed": fns.get("finish_buckets")}
    return Version(name, setup, sync[name], source)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------- training and counting


def train(version: Version, rank: int, world_size: int, device: torch.device,
          steps: int = STEPS, same_start: bool = False, model_kw: dict | None = None) -> dict:
    """Train a TiedNet for `steps` SGD steps with `version` keeping the replicas in sync.
    Each rank starts from its own weights (seed = rank) unless same_start. Returns the
    parameters after setup and after training, the losses, and the collectives of each step."""
    kw = model_kw or SMALL
    model = tied_model(seed=0 if same_start else rank, **kw).to(device)
    module, state = version.setup(model)
    after_setup = flat_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # frozen: no gradient, left alone
    losses, collectives, sent = [], [], []
    for step in range(steps):
        x, y = rank_batch(step, rank, world_size, device, vocab=kw["vocab"])
        opt.zero_grad()

        def one_step(x=x, y=y):
            loss = loss_fn(module(x), y)
            loss.backward()
            version.sync(state)
            losses.append(loss.item())

        summary = collective_bytes(one_step)  # the Ledger: {op: (calls, bytes handed in)}
        collectives.append({op: n for op, (n, _) in summary.items()})
        sent.append(sum(b for _, b in summary.values()))
        opt.step()
    return {"version": version.name, "source": version.source, "after_setup": after_setup,
            "params": flat_params(model), "losses": losses, "collectives": collectives,
            "bytes": sent}


def single_process(steps: int = STEPS, model_kw: dict | None = None,
                   size: int = BATCH) -> torch.Tensor:
    """The reference: one process, rank 0's initial weights, the whole batch each step (its
    first `size` samples: what the ranks' equal shares cover when BATCH does not divide)."""
    kw = model_kw or SMALL
    model = tied_model(seed=0, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = (t[:size] for t in global_batch(step, vocab=kw["vocab"]))
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return flat_params(model)


def run_version(name: str, namespace: dict | None, rank: int, world_size: int,
                device: torch.device, steps: int = STEPS, bucket_mb: float = 0.002) -> dict:
    """Train version `name` (yours where written, else the kit's) and torch's DDP side by side
    from per-rank starts, and compare both with one process; a record for the parent."""
    mine = train(make_version(name, namespace, bucket_mb), rank, world_size, device, steps)
    ddp = train(make_version("ddp", bucket_mb=bucket_mb), rank, world_size, device, steps)
    single = single_process(steps)
    return {**mine, "equals_ddp": case("ddp", mine["params"], ddp["params"], RTOL, ATOL).ok,
            "equals_single": case("one", mine["params"], single, RTOL, ATOL).ok,
            "ddp_collectives": ddp["collectives"]}


def describe(records: list[dict]) -> str:
    """The deterministic lines the notebook prints for one version's per-rank records."""
    first = records[0]
    per_step = "; ".join(f"{_counts(c)} ({b:,} B)"
                         for c, b in zip(first["collectives"], first["bytes"]))
    yes = {True: "yes", False: "NO"}
    agree = all(torch.equal(r["params"], first["params"]) for r in records)
    # torch's DDP against a second run of itself says nothing: that line is for the others.
    against_ddp = ("" if first["version"] == "ddp" else
                   f"  parameters equal torch's DDP (rtol={RTOL:g}, atol={ATOL:g}), on every "
                   f"rank: {yes[all(r['equals_ddp'] for r in records)]}\n")
    return (f"{first['version']} ({first['source']}), {len(first['losses'])} SGD steps:\n"
            + against_ddp +
            f"  parameters equal one process on the whole batch (rtol={RTOL:g}, atol={ATOL:g}), "
            "on every rank: "
            f"{yes[all(r['equals_single'] for r in records)]}\n"
            f"  the ranks' parameters are equal bit for bit: {yes[agree]}\n"
            f"  collectives in each step (rank 0), with the bytes it handed in: {per_step}")


def _counts(collectives: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in collectives.items()) or "none"


# ---------------------------------------------------------------- timing


def stepper(version: Version, rank: int, world_size: int,
            device: torch.device) -> Callable[[], None]:
    """One training step (forward, backward, sync, SGD step) of the large TiedNet with
    `version`, as a function to call; the replicas start equal."""
    model = tied_model(0, **LARGE).to(device)
    module, state = version.setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = rank_batch(0, rank, world_size, device, LARGE_BATCH, LARGE["vocab"])

    def one_step() -> None:
        opt.zero_grad()
        loss_fn(module(x), y).backward()
        version.sync(state)
        opt.step()

    return one_step


def round_seconds(steps: dict[str, Callable[[], None]], device: torch.device,
                  rounds: int = 12, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each step function in each round, timed in turns (one call of each per
    round), so that a burst of load from elsewhere on the machine hits them all alike. The
    warm-up rounds also let DDP rebuild its buckets (after its first step)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + rounds):
        for name, step in steps.items():
            with Timer(device) as t:
                step()
            if i >= warmup:
                times[name].append(t.seconds)
    return times


def median_seconds(steps: dict[str, Callable[[], None]], device: torch.device,
                   rounds: int = 12, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each step function over the rounds of round_seconds."""
    return {name: statistics.median(ts)
            for name, ts in round_seconds(steps, device, rounds, warmup).items()}


def time_versions(namespace: dict | None, rank: int, world_size: int, device: torch.device,
                  bucket_mb: float = 0.5, rounds: int = 12) -> dict[str, dict]:
    """Every version on the large TiedNet, on this rank: {name: {"seconds": median step
    seconds, "rounds": each round's seconds, "collectives": one more step's collectives,
    counted}}."""
    steps = {name: stepper(make_version(name, namespace, bucket_mb, broadcast=False), rank,
                           world_size, device) for name in TIMED}
    each = round_seconds(steps, device, rounds)
    sent = {name: collective_bytes(step) for name, step in steps.items()}  # one more step each
    return {name: {"seconds": statistics.median(each[name]), "rounds": each[name],
                   "collectives": {op: n for op, (n, _) in sent[name].items()},
                   "bytes": sum(b for _, b in sent[name].values())} for name in steps}


def median_of(times: list[dict], name: str) -> float:
    """The median over ranks of version `name`'s step time."""
    return statistics.median(per_rank[name]["seconds"] for per_rank in times)


def describe_times(times: list[dict]) -> str:
    """Median step time of each version on each rank, with the fastest and slowest round, in
    ms (not reproducible: a measurement)."""
    lines = ["version      " + "".join(f"rank {r}: median (min-max)  " for r in range(len(times)))]
    for name in times[0]:
        lines.append(f"{name:<13}" + "".join(
            f"{t[name]['seconds'] * 1000:<7.1f}({min(t[name]['rounds']) * 1000:.1f}-"
            f"{max(t[name]['rounds']) * 1000:.1f})".ljust(25) for t in times))
    return "\n".join(lines)


def slower_rounds(times: list[dict], slow: str, fast: str) -> list[int]:
    """On each rank, the number of rounds in which version `slow`'s step took longer than
    `fast`'s (the two timed in the same round, so that load from elsewhere hits both)."""
    return [sum(a > b for a, b in zip(t[slow]["rounds"], t[fast]["rounds"])) for t in times]


def describe_naive_against_flat(times: list[dict]) -> str:
    """Whether naive's 14 calls made its step longer than flat's one call in most rounds, on
    every rank (the counts themselves vary from run to run: only the verdict is compared)."""
    rounds = len(times[0]["naive"]["rounds"])
    most = all(n > rounds / 2 for n in slower_rounds(times, "naive", "flat"))
    return (f"naive's step longer than flat's in most of the {rounds} rounds, on every rank: "
            f"{'yes' if most else 'NO'}")


def describe_collectives(times: list[dict], bucket_mb: float) -> str:
    """What is deterministic about the timed runs: the collectives of one step, per version."""
    same = all(t[n]["collectives"] == times[0][n]["collectives"] for t in times for n in t)
    lines = [f"collectives in one step of the large TiedNet (buckets of {bucket_mb:g} MiB), "
             f"the same on every rank: {'yes' if same else 'NO'}"]
    lines += [f"  {name:<11} {_counts(times[0][name]['collectives']):<16}"
              f"{times[0][name]['bytes']:>10,} bytes handed in" for name in times[0]]
    return "\n".join(lines)


def bucket_sweep(namespace: dict | None, rank: int, world_size: int, device: torch.device,
                 caps_mb: tuple[float, ...] = SWEEP_CAPS_MB, rounds: int = 12) -> list[dict]:
    """For each bucket cap: the bytes of each bucket the bucketed version makes (the last one
    is sent last), its median step time on this rank and one step's collectives."""
    make = _functions("bucketed_ddp", namespace)[0]["make_buckets"]
    steps = {cap: stepper(make_version("bucketed", namespace, cap, broadcast=False), rank,
                          world_size, device) for cap in caps_mb}
    seconds = median_seconds(steps, device, rounds)
    return [{"cap_mb": cap, "seconds": seconds[cap],
             "all_reduces": {op: n for op, (n, _) in collective_bytes(step).items()},
             "bucket_bytes": [gradient_bytes(b) for b in make(tied_model(0, **LARGE), cap)]}
            for cap, step in steps.items()]


def allreduce_seconds(device: torch.device, sizes: list[int], rounds: int = 15) -> list[float]:
    """Median seconds of one all_reduce of each size in bytes (float32) on this rank, the
    sizes timed in turns (a burst of outside load then hits every size alike)."""
    tensors = {n: torch.ones(max(1, n // 4), device=device) for n in sizes}
    steps = {n: (lambda t=t: dist.all_reduce(t)) for n, t in tensors.items()}
    seconds = median_seconds(steps, device, rounds, warmup=2)
    return [seconds[n] for n in sizes]


# ---------------------------------------------------------------- the exercises' checks
# Each check trains the learner's version next to torch's DDP (the results), and watches one
# step of it on every rank with the Ledger (the mechanism): which all_reduces, of which sizes,
# and, for the overlapped and bucketed versions, how many gradients backward had produced when
# each was called, with every rank but 0 made to finish its backward before rank 0 starts its
# own, so that an all_reduce that waits inside backward cannot go unseen.

PROBE_WAIT_S = 10.0  # rank 0's wait for the others' backward of a tiny model (milliseconds)
BOUNDARY_MB = 1088 / 2**20  # the last layer's bias and weight exactly: a bucket hits the cap
ABOVE_MB = 1089 / 2**20  # one byte more: read as 1e6 bytes per MB, it cuts elsewhere
CHECK_CAPS_MB = (0.002, 1e-6, BOUNDARY_MB, ABOVE_MB, 1.0)  # 2 buckets, one each, ..., all in one
_CAP_LABELS = {BOUNDARY_MB: "1088 B (a bucket holds the cap exactly)",
               ABOVE_MB: "1089 B (one byte above a bucket)"}


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def odd_model(seed: int = 0) -> TiedNet:
    """The small TiedNet with its frozen layer's bias frozen too: 5 gradients (an odd count)
    and 2 frozen tensors."""
    model = tied_model(seed, **SMALL)
    model.frozen.bias.requires_grad_(False)
    return model


ODD = "one step (5 gradients, 2 frozen tensors)"
TRAINING = f"{STEPS} steps against torch's DDP"


def _trained_cases(version: Version, namespace: dict, same_start: bool,
                   all_reduces: int) -> list[Case]:
    """Train `version` and torch's DDP from the same starts; compare both with one process on
    the whole batch, and count the collectives of each step."""
    rank, world_size, device = namespace["rank"], namespace["world_size"], namespace["device"]
    mine = train(version, rank, world_size, device, STEPS, same_start)
    ddp = train(make_version("ddp"), rank, world_size, device, STEPS)
    cases = []
    if not same_start:  # every rank's, so that rank 0 (whose own are right) sees a wrong rank
        setups = [torch.empty_like(mine["after_setup"]).to(device) for _ in range(world_size)]
        dist.all_gather(setups, mine["after_setup"].to(device))
        initial = flat_params(tied_model(0, **SMALL))
        cases.append(case("parameters after broadcast_parameters, every rank's (rank, index), "
                          "against rank 0's initial ones", torch.stack(setups).cpu(),
                          initial.expand(world_size, -1), 0, 0))
    cases += [
        case(f"parameters after {STEPS} steps, against torch's DDP", mine["params"],
             ddp["params"], RTOL, ATOL),
        case(f"parameters after {STEPS} steps, against one process on the whole batch",
             mine["params"], single_process(STEPS, size=BATCH // world_size * world_size),
             RTOL, ATOL),
        case("collectives in each step", mine["collectives"],
             [{"all_reduce": all_reduces}] * STEPS),
    ]
    return cases


def _with_gradient() -> int:
    return sum(p.requires_grad for p in tied_model(0, **SMALL).parameters())


@dataclass
class Step:
    """One watched step on this rank: the gradients after the sync, the collectives called,
    how many gradients were ready at each call, how many calls came before backward returned,
    the gradients in the order backward produced them, and (rank 0, when forced) whether the
    other ranks' backward returned before rank 0 began its own."""

    grads: dict[str, torch.Tensor | None]
    expected: dict[str, torch.Tensor | None]
    calls: list
    ready_at_call: list[int]
    in_backward: int
    ready: list[str]
    others_returned: bool | None


def _mean_gradients(model: nn.Module, x, y) -> dict[str, torch.Tensor | None]:
    """Each gradient's mean over the ranks, from a copy of `model` (the reference)."""
    import copy

    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for g in grads.values():
        if g is not None:
            dist.all_reduce(g)
            g /= dist.get_world_size()
    return grads


def _safely(label: str, cases: Callable[[], list[Case]]) -> list[Case]:
    """cases(), or one failed case naming what the learner's functions raised (so that the
    cases before it, e.g. wrong buckets, still show)."""
    try:
        return cases()
    except Exception as e:  # noqa: BLE001 - a crashing answer is a wrong answer
        first = (str(e).splitlines() or [""])[0]
        return [Case(label, False, f"your functions raised {type(e).__name__}: {first}")]


def _grads(model: nn.Module) -> dict:
    """Each parameter's gradient, copied to the CPU (None where there is none)."""
    return {n: None if p.grad is None else p.grad.detach().clone().cpu()
            for n, p in model.named_parameters()}


def watch_step(setup: Callable, sync: Callable, model: nn.Module, namespace: dict,
               forced: bool, late: bool = False) -> Step:
    """One step of a version (setup(model) -> state, then sync(state) after backward), watched
    by the Ledger and by hooks that count the gradients as backward makes them. forced: ranks
    1.. finish backward before rank 0 begins its own (through the store, not a collective).
    late: rank 0 calls sync only once the others' sync returned (races.rank_zero_last), so that
    a sync that returns before its all_reduce finished (async_op=True, never waited) hands
    back gradients that cannot be the mean, every run: the race made certain, not left to luck."""

    from ..ledger import Ledger

    rank, world_size, device = namespace["rank"], namespace["world_size"], namespace["device"]
    model = model.to(device)
    x, y = rank_batch(0, rank, world_size, device)  # each rank its share: gradients differ
    expected = _mean_gradients(model, x, y)
    state = setup(model)  # the learner's hooks first: ours, registered after, run after theirs
    names, ready, at_call = _names(model), [], []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.append(names[id(p)]))
             for p in model.parameters() if p.requires_grad]
    key = agreed_key("ddp_from_scratch/step", device) if forced or late else ""
    others = None
    try:
        with Ledger(on_call=lambda call: at_call.append(len(ready))) as ledger:
            if forced and rank == 0:
                others = others_said(key, PROBE_WAIT_S)  # False: a rank is stuck in backward
            loss_fn(model(x), y).backward()
            in_backward = len(ledger.calls)
            if forced and rank != 0:
                say(key)
            if late:
                grads = rank_zero_last(key, lambda: sync(state), lambda _: _grads(model))
            else:
                sync(state)
                grads = _grads(model)
    finally:
        for h in hooks:
            h.remove()
    return Step(grads, {n: None if g is None else g.cpu() for n, g in expected.items()},
                ledger.calls, at_call, in_backward, ready, others)


def _gradient_cases(step: Step, label: str, fn: str) -> list[Case]:
    """Each gradient after `fn` against its mean over the ranks (a frozen one: still None)."""
    return [case(f"{label}: gradient of {n} after {fn}", step.grads[n], want, RTOL, ATOL)
            for n, want in step.expected.items()]


def _calls_text(calls: list) -> str:
    return ", ".join(c.text() for c in calls) or "no collective"


def _tensor_text(nbytes: int) -> str:
    return f"float32[{nbytes // 4}]"


def _per_gradient_case(step: Step, label: str) -> Case:
    """One all_reduce of each gradient, whole, in any order, and nothing else."""
    want = sorted((tuple(g.shape),) for g in step.expected.values() if g is not None)
    got = sorted(c.shapes for c in step.calls if c.op == "all_reduce")
    ok = got == want and all(c.op == "all_reduce" for c in step.calls)
    return Case(f"{label}: collectives", ok,
                f"called {_calls_text(step.calls)}; expected one all_reduce of each of the "
                f"{len(want)} gradients")


def _started_in_backward(step: Step, label: str, ceilings: list[int], what: str) -> list[Case]:
    """The i-th all_reduce called by the time backward had made ceilings[i] gradients (from
    the hook of the gradient that completes it), all before backward returned; rank 0, when
    the others were made to finish first, saw their backward return with its work in flight."""
    n, cases = len(ceilings), []
    late = [i for i, (got, most) in enumerate(zip(step.ready_at_call, ceilings)) if got > most]
    first = late[0] if late else 0
    cases.append(Case(f"{label}: {what} started as backward made the gradients",
                      step.in_backward == n and not late and len(step.calls) == n,
                      f"{step.in_backward} of the {len(step.calls)} collectives were called "
                      f"before backward returned (expected {n}: {what}, each from a hook); "
                      + (f"all_reduce #{first + 1} was called once {step.ready_at_call[first]} "
                         f"of {len(step.ready)} gradients were ready, expected by the time "
                         f"{ceilings[first]} were" if late else
                         f"called {_calls_text(step.calls)}")))
    if step.others_returned is not None:
        cases.append(Case(f"{label}: the other ranks' backward returned before rank 0 began "
                          "its own", step.others_returned,
                          f"rank 0 waited {PROBE_WAIT_S:g} s and another rank's backward had not "
                          "returned: a hook waits for its all_reduce (a blocking all_reduce, or "
                          ".wait() in the hook); start it with async_op=True and wait in the "
                          "finish function"))
    return cases


@exercise_check("naive_ddp", "ranks")
def check_naive_ddp(namespace: dict) -> list[Case]:
    """broadcast_parameters + naive_average: equal to DDP, one all-reduce of each gradient."""
    fns = dict(zip(FUNCTIONS["naive_ddp"], require(namespace, *FUNCTIONS["naive_ddp"])))

    def one_step() -> list[Case]:
        step = watch_step(lambda m: m, fns["naive_average"], odd_model(), namespace, False,
                          late=True)
        return [*_gradient_cases(step, ODD, "naive_average"), _per_gradient_case(step, ODD)]

    version = _build("naive", fns, fns["broadcast_parameters"], 0, "yours")
    return _safely(ODD, one_step) + _safely(TRAINING, lambda: _trained_cases(
        version, namespace, same_start=False, all_reduces=_with_gradient()))


@exercise_check("flat_ddp", "ranks")
def check_flat_ddp(namespace: dict) -> list[Case]:
    """flat_average: equal to DDP with a single all-reduce of every gradient's bytes."""
    flat_average = require(namespace, "flat_average")

    def one_step() -> list[Case]:
        step = watch_step(lambda m: m, flat_average, odd_model(), namespace, forced=False,
                          late=True)
        size = sum(g.numel() * 4 for g in step.expected.values() if g is not None)
        one = [(c.op, c.nbytes) for c in step.calls] == [("all_reduce", size)]
        return [*_gradient_cases(step, ODD, "flat_average"),
                Case(f"{ODD}: collectives", one,
                     f"called {_calls_text(step.calls)}; expected one all_reduce of "
                     f"{_tensor_text(size)}: every gradient (none for a frozen tensor), "
                     "flattened")]

    version = _build("flat", {"flat_average": flat_average}, None, 0, "yours")
    return _safely(ODD, one_step) + _safely(TRAINING, lambda: _trained_cases(
        version, namespace, same_start=True, all_reduces=1))


@exercise_check("overlapped_ddp", "ranks")
def check_overlapped_ddp(namespace: dict) -> list[Case]:
    """attach_overlap_hooks + finish_overlap: equal to DDP, one all-reduce of each gradient,
    each started from its gradient's hook during backward and still in flight when it ends."""
    fns = dict(zip(FUNCTIONS["overlapped_ddp"],
                   require(namespace, *FUNCTIONS["overlapped_ddp"])))

    def one_step() -> list[Case]:
        step = watch_step(fns["attach_overlap_hooks"], fns["finish_overlap"], odd_model(),
                          namespace, forced=True)
        ceilings = list(range(1, len(step.ready) + 1))  # all_reduce i once gradient i is ready
        return [*_gradient_cases(step, ODD, "finish_overlap"), _per_gradient_case(step, ODD),
                *_started_in_backward(step, ODD, ceilings, "one all_reduce per gradient")]

    version = _build("overlapped", fns, None, 0, "yours")
    return _safely(ODD, one_step) + _safely(TRAINING, lambda: _trained_cases(
        version, namespace, same_start=True, all_reduces=_with_gradient()))


def _bucket_name_cases(make_buckets: Callable, kit: Callable) -> list[Case]:
    """The learner's buckets, as parameter names, against the rule's, for every check cap on
    the small TiedNet and on the one with 5 gradients."""
    cases = []
    for label, build in (("", lambda: tied_model(0, **SMALL)), (" (5 gradients)", odd_model)):
        model = build()
        names = _names(model)
        for cap in CHECK_CAPS_MB:
            got = make_buckets(model, cap)
            got = None if got is None else [[names.get(id(p), "?") for p in b] for b in got]
            want = [[names[id(p)] for p in b] for b in kit(model, cap)]
            cases.append(case(f"make_buckets(model{label}, {_CAP_LABELS.get(cap, f'{cap:g}')})"
                              ", parameter names", got, want))
    return cases


def _bucket_step_cases(fns: dict, kit: Callable, namespace: dict) -> list[Case]:
    """One watched step with buckets of 1088 B: their all_reduces in backward's order, of the
    buckets' sizes, each started by the hook of its last gradient, in flight at the end."""
    model = odd_model()
    step = watch_step(lambda m: fns["attach_bucket_hooks"](m, fns["make_buckets"](m, BOUNDARY_MB)),
                      fns["finish_buckets"], model, namespace, forced=True)
    names = _names(model)
    buckets = [[names[id(p)] for p in b] for b in kit(model, BOUNDARY_MB)]
    sizes = [gradient_bytes(b) for b in kit(model, BOUNDARY_MB)]
    order = step.ready or [n for b in buckets for n in b]
    ceilings = [max(order.index(n) for n in b) + 1 for b in buckets]
    label = f"{ODD}, buckets of 1088 B"
    got = [(c.op, c.nbytes) for c in step.calls]
    sized = Case(f"{label}: collectives", got == [("all_reduce", s) for s in sizes],
                 f"called {_calls_text(step.calls)}; expected one all_reduce per bucket, "
                 f"last layer first: {', '.join(map(_tensor_text, sizes))}")
    return [*_gradient_cases(step, label, "finish_buckets"), sized,
            *_started_in_backward(step, label, ceilings, "one all_reduce per bucket")]


@exercise_check("bucketed_ddp", "ranks")
def check_bucketed_ddp(namespace: dict) -> list[Case]:
    """make_buckets against DDP's rule for five caps on two models, one watched step (the
    buckets' all_reduces, in order, started in backward), then training."""
    fns = dict(zip(FUNCTIONS["bucketed_ddp"], require(namespace, *FUNCTIONS["bucketed_ddp"])))
    kit = solution_module("bucketed_ddp").make_buckets
    cases = _bucket_name_cases(fns["make_buckets"], kit)
    cases += _safely(f"{ODD}, buckets of 1088 B", lambda: _bucket_step_cases(fns, kit,
                                                                               namespace))
    expected = len(kit(tied_model(0, **SMALL), CHECK_CAPS_MB[0]))
    version = _build("bucketed", fns, None, CHECK_CAPS_MB[0], "yours")
    return cases + _safely(TRAINING, lambda: _trained_cases(
        version, namespace, same_start=True, all_reduces=expected))


# ---------------------------------------------------------------- the cost model


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Fit t = alpha + n / B to all-reduce times of n bytes; return (alpha s, B bytes/s).
    Least squares on relative errors, so 4-byte and 4-MiB messages count alike."""
    t = torch.tensor(seconds, dtype=torch.float64)
    a = torch.stack([1 / t, torch.tensor(sizes, dtype=torch.float64) / t], dim=1)
    alpha, inverse_b = torch.linalg.lstsq(a, torch.ones_like(t).unsqueeze(1)).solution.flatten()
    return float(alpha), float(1 / inverse_b)


def predicted_seconds(compute_s: float, alpha: float, bandwidth: float,
                      bucket_bytes: list[int], overlap: bool = True) -> float:
    """The model's step time: compute, plus alpha for each bucket (one call after another),
    plus transfers. overlap=True: only the last bucket's transfer shows, the others hide behind
    backward (a GPU, where NCCL has its own engines); False: every byte shows (CPU ranks whose
    communication threads share the cores with backward)."""
    shown = bucket_bytes[-1] if overlap else sum(bucket_bytes)
    return compute_s + alpha * len(bucket_bytes) + shown / bandwidth


def best_bucket_bytes(alpha: float, bandwidth: float, total_bytes: float) -> float:
    """The bucket size b that minimises alpha * S/b + b/B (S/b buckets, the last b exposed):
    b* = sqrt(alpha * B * S). That model holds when backward makes gradients at about the link's
    rate R ~ B, so read it as sqrt(alpha * R * S) (the link-bound optimum at its edge), not as a
    bucket that grows with B."""
    return (alpha * bandwidth * total_bytes) ** 0.5


def gradient_order(device: torch.device) -> list[str]:
    """The order in which the small TiedNet's gradients become ready in one backward."""
    model = tied_model(0, **SMALL).to(device)
    names, order = {id(p): n for n, p in model.named_parameters()}, []
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
    x, y = rank_batch(0, 0, 1, device)
    loss_fn(model(x), y).backward()
    return order


def compare_with_model(sweeps: list[list[dict]], compute_s: float, alpha: float,
                       bandwidth: float) -> str:
    """Measured step time per cap and rank beside both models', and the minima."""
    lines = ["cap MiB  buckets  " + "".join(f"rank {r} ms  " for r in range(len(sweeps)))
             + "overlap  no overlap (model ms)"]
    for i, row in enumerate(sweeps[0]):
        models = [predicted_seconds(compute_s, alpha, bandwidth, row["bucket_bytes"], o) * 1000
                  for o in (True, False)]
        measured = "".join(f"{s[i]['seconds'] * 1000:<11.1f}" for s in sweeps)
        lines.append(f"{row['cap_mb']:<9g}{len(row['bucket_bytes']):<9}{measured}"
                     f"{models[0]:<9.1f}{models[1]:.1f}")
    mean = [statistics.mean(s[i]["seconds"] for s in sweeps) for i in range(len(sweeps[0]))]
    fastest = sweeps[0][mean.index(min(mean))]["cap_mb"]
    best = best_bucket_bytes(alpha, bandwidth, sum(sweeps[0][0]["bucket_bytes"])) / 2**20
    above = sum(min(s[i]["seconds"] for s in sweeps) > predicted_seconds(
        compute_s, alpha, bandwidth, row["bucket_bytes"], False) for i, row in enumerate(sweeps[0]))
    lines.append(f"measured minimum (mean of the ranks): cap {fastest:g} MiB; overlap model: "
                 f"b* = sqrt(alpha*R*S) = {best:.2g} MiB, with R (backward's gradient rate, "
                 f"not measured) taken as this run's B; no-overlap model: one bucket")
    lines.append(f"measured above the no-overlap model at {above} of {len(sweeps[0])} caps")
    return "\n".join(lines)


def describe_sweep(sweeps: list[list[dict]]) -> str:
    """What is deterministic about the sweep: the buckets per cap and their all-reduces."""
    lines = []
    for row in sweeps[0]:
        sizes = row["bucket_bytes"]
        plural = "s" * (len(sizes) != 1)
        lines.append(f"cap {row['cap_mb']:g} MiB: {len(sizes)} bucket{plural}, the last "
                     f"{sizes[-1] / 2**20:.2f} MiB; all-reduces counted in one step: "
                     f"{row['all_reduces'].get('all_reduce', 0)}")
    timed = all(len(s) == len(sweeps[0]) for s in sweeps)
    lines.append(f"every rank timed every cap: {'yes' if timed else 'NO'}")
    return "\n".join(lines)
