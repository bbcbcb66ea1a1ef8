"""Lesson 10: past DDP. Where a rank's memory goes (DDP, ZeRO-1, FSDP2), what each sends per step,
and gradient compression with DDP's communication hooks.

Run on persistent ranks (`%%ranks`): every function here takes the rank's `rank, world_size,
device` and returns plain records for the parent to print and plot. The model is a small MLP
of blocks, so FSDP2 has layers to shard one by one; the data are a synthetic classification
task, the same on any machine: a fixed random linear teacher labels Gaussian inputs.
"""

from __future__ import annotations

import contextlib
import numbers
import re
import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat
from ..checks import Case, case
from ..collectives import count_collectives
from ..data import rank_share
from ..exercises import NotAttempted, exercise_check, require, solution_module
from ..ledger import record
from ..runtime import device_ids

IN, WIDTH, BLOCKS, CLASSES = 32, 128, 3, 10
BATCH, STEPS, LR = 16, 20, 3e-3  # per rank; Adam
RTOL, ATOL = 1e-5, 1e-6
KINDS = ("ddp", "zero1 (torch)", "zero1 (yours)", "fsdp2")
DDP_CAPS_MB = (0.05, 0.1, 25.0)


# ---------------------------------------------------------------- model and data


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(32, 128) + ReLU, three blocks of Linear(128, 128) + ReLU, Linear(128, 10): the
    blocks are what FSDP2 shards one by one (55,050 parameters)."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    return nn.Sequential(nn.Linear(IN, WIDTH), nn.ReLU(), *blocks, nn.Linear(WIDTH, CLASSES))


def blocks_of(model: nn.Sequential) -> list[nn.Module]:
    """The blocks FSDP2 wraps on their own (the first and last layers stay with the root)."""
    return list(model[2:2 + BLOCKS])


def _teacher() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Linear(IN, CLASSES)  # labels: the largest of 10 random projections


@torch.no_grad()
def samples(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n inputs and the teacher's labels for them; depends only on `seed`."""
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
    return x, _teacher()(x).argmax(dim=1)


def rank_batch(step: int, rank: int, world_size: int, device: torch.device,
               size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's `size` samples of step `step` (the global batch is size x world_size)."""
    return rank_share(samples(10_000 + step, size * world_size), rank, world_size, device)


def param_count(model: nn.Module) -> int:
    """Parameters of the model (each tensor once)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- memory


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def memory_of(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from the
    tensors themselves (a DTensor counts its local shard only). "copies": tensors the
    optimizer steps that are not the model's (a hand-written ZeRO's shard and its gradient)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: its local Adam
    state = [t for s in inner.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]  # not Adam's step counters
    params = list(model.parameters())
    mine = {id(p) for p in params}
    copies = [t for g in inner.param_groups for p in g["params"] if id(p) not in mine
              for t in (p, p.grad)]
    return {"parameters": _bytes(params), "gradients": _bytes(p.grad for p in params),
            "optimizer": _bytes(state), "copies": _bytes(copies)}


def peak_kib(tracker) -> dict[str, float]:
    """The peak an FSDPMemTracker (or MemTracker) saw on this rank's device, in KiB: in all,
    and the unsharded parameters held at that moment (0 outside FSDP2)."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_name = {getattr(kind, "value", kind): n for kind, n in snapshot.items()}
    return {"peak": round(by_name["Total"] / 1024, 1),
            "unsharded parameters then": round(by_name.get("Unsharded Param", 0) / 1024, 1),
            "all-gather buffers then": round(by_name.get("All Gather", 0) / 1024, 1)}


def step_peak_kib(kind: str, rank: int, world_size: int, device: torch.device,
                  namespace: dict | None = None) -> float:
    """The peak KiB of tensors alive during one whole step (forward, backward, optimizer step)
    of `kind`, the second step of a fresh run (the first creates Adam's state), as torch's
    MemTracker (FSDPMemTracker for FSDP2) sees it on this rank's thread."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    model = mlp(0).to(device)
    module, step, opt = setup_training(kind, model, device, namespace)
    with quiet_fsdp2():
        for i in range(2):
            if i == 1:
                if kind == "fsdp2":
                    tracker = FSDPMemTracker(model, opt)
                else:
                    tracker = MemTracker()
                    tracker.track_external(model, opt)
            x, y = rank_batch(i, rank, world_size, device)
            with tracker if i == 1 else contextlib.nullcontext():
                F.cross_entropy(module(x), y).backward()
                step()
                model.zero_grad(set_to_none=False)
    return peak_kib(tracker)["peak"]


def step_peaks(rank: int, world_size: int, device: torch.device,
               namespace: dict | None = None) -> dict[str, float]:
    """step_peak_kib for each of the four ways to train, on this rank."""
    return {kind: step_peak_kib(kind, rank, world_size, device, namespace) for kind in KINDS}


def describe_peaks(runs: list[list[dict]], peaks: list[dict[str, float]]) -> str:
    """Per way and rank: the KiB kept after the first step (parameters, gradients, optimizer
    state, copies) beside the peak of a whole step."""
    lines = ["KiB per rank: kept after a step / peak during a step"]
    for i, first in enumerate(runs[0]):
        kind = first["kind"]
        cells = "  ".join(f"rank {r}: {sum(per_rank[i]['memory'].values()) / 1024:6.1f} / "
                          f"{peaks[r][kind]:6.1f}" for r, per_rank in enumerate(runs))
        lines.append(f"  {kind:<14} {cells}")
    return "\n".join(lines)


def compare_peaks(runs: list[list[dict]], peaks: list[dict[str, float]]) -> str:
    """The orderings of describe_peaks that hold by a wide margin (compared by nbval)."""
    kept = [{r["kind"]: sum(r["memory"].values()) / 1024 for r in per_rank} for per_rank in runs]
    above = all(peaks[r][k] > kept[r][k] for r in range(len(runs)) for k in KINDS)
    yours = all(p["zero1 (yours)"] == max(p.values()) > p["ddp"] for p in peaks)
    fsdp2 = all(p["fsdp2"] < p["ddp"] for p in peaks)
    yes = {True: "yes", False: "NO"}
    return (f"on every rank: every way's peak above what it keeps: {yes[above]}\n"
            f"  hand-written ZeRO-1's peak the highest of the four: {yes[yours]}\n"
            f"  FSDP2's peak below DDP's: {yes[fsdp2]}")


def fsdp2_peak_rounds(rank: int, world_size: int, device: torch.device,
                      rounds: int = 3) -> dict[bool, list[dict[str, float]]]:
    """For reshard_after_forward True and False, `rounds` fresh FSDP2 models: peak_kib of the
    forward and backward of each one's second step (the first makes Adam's state)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    fully_shard = compat.fsdp2_fully_shard()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    out: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for reshard in (True, False):
        for _ in range(rounds):
            model = mlp(0).to(device)
            for block in blocks_of(model):
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=LR)
            for i in range(2):
                x, y = rank_batch(i, rank, world_size, device)
                tracker = FSDPMemTracker(model, opt)
                with quiet_fsdp2(), tracker:
                    loss = F.cross_entropy(model(x), y)
                    between = _unsharded_kib(model)
                    loss.backward()
                opt.step()
                opt.zero_grad()
            out[reshard].append({**peak_kib(tracker), "unsharded between": between})
    return out


def _unsharded_kib(model: nn.Module) -> float:
    """KiB of the parameters that are whole tensors right now: FSDP2 registers a group's
    unsharded parameters in place of its DTensors from its all-gather until it reshards."""
    return round(sum(p.numel() * p.element_size() for p in model.parameters()
                     if not hasattr(p, "to_local")) / 1024, 1)


def describe_fsdp2_peaks(rounds: list[dict]) -> str:
    """The range over rounds and ranks of each peak_kib entry, per setting."""
    lines = []
    for reshard, label in ((True, "resharded after forward (default)"),
                           (False, "kept for backward")):
        seen = [p for per_rank in rounds for p in per_rank[reshard]]
        cells = ", ".join(f"{k} {min(p[k] for p in seen):g}-{max(p[k] for p in seen):g}"
                          for k in seen[0] if k != "unsharded between")
        lines.append(f"{label}, {len(seen)} rounds x ranks, KiB at the peak: {cells}")
    return "\n".join(lines)


def compare_fsdp2_peaks(rounds: list[dict]) -> str:
    """What each setting holds unsharded between forward and backward (deterministic), and
    whether every round on every rank held the same."""
    lines = ["unsharded parameters between forward and backward:"]
    for reshard, label in ((True, "resharded after forward (default)"),
                           (False, "kept for backward")):
        seen = {p["unsharded between"] for per_rank in rounds for p in per_rank[reshard]}
        value = f"{seen.pop():g} KiB in every round on every rank" if len(seen) == 1 else \
            f"differs between rounds: {sorted(seen)}"
        lines.append(f"  {label:<34} {value}")
    return "\n".join(lines)


def zero_paper_example(psi: float = 7.5e9, n: int = 64) -> str:
    """The ZeRO paper's example (Rajbhandari et al., 2020, figure 1): mixed-precision Adam,
    2 bytes per parameter and per gradient, 12 of optimizer state (float32 master weights and
    the two moments), per GPU for each stage; activations and buffers not counted."""
    p, g, k = 2 * psi, 2 * psi, 12 * psi
    stages = {"DDP": p + g + k, "ZeRO-1": p + g + k / n, "ZeRO-2": p + (g + k) / n,
              "ZeRO-3 (FSDP)": (p + g + k) / n}
    lines = [f"{psi / 1e9:g}B parameters, {n} GPUs, mixed-precision Adam: GB per GPU"]
    lines += [f"  {name:<14} {b / 1e9:6.1f}" for name, b in stages.items()]
    return "\n".join(lines)


def formulas(psi: int, world_size: int) -> dict[str, dict[str, float]]:
    """ZeRO paper's accounting for fp32 Adam: 4 bytes per parameter, per gradient, and 8 of
    Adam state (exp_avg, exp_avg_sq); ZeRO-1 shards the state, FSDP (ZeRO-3) everything."""
    p, n = 4 * psi, world_size
    return {"ddp": {"parameters": p, "gradients": p, "optimizer": 2 * p},
            "zero1": {"parameters": p, "gradients": p, "optimizer": 2 * p / n},
            "fsdp2": {"parameters": p / n, "gradients": p / n, "optimizer": 2 * p / n}}


# ---------------------------------------------------------------- four ways to train


def setup_training(kind: str, model: nn.Module, device: torch.device,
                   namespace: dict | None = None):
    """(module to call, step function, optimizer) for one of the four ways to train."""
    if kind == "ddp":
        ddp = DDP(model, device_ids=device_ids(device), gradient_as_bucket_view=True)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        return ddp, opt.step, opt
    if kind == "zero1 (torch)":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model, device_ids=device_ids(device), gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
        return ddp, opt.step, opt
    if kind == "zero1 (yours)":
        fns = _zero1_functions(namespace)
        shard = fns["make_shard"](model)
        opt = torch.optim.Adam([shard], lr=LR)
        return model, lambda: fns["zero1_step"](model, shard, opt), opt
    if kind == "fsdp2":
        shard_fully(model, device)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        return model, opt.step, opt
    raise ValueError(f"unknown kind {kind!r}: choose one of {KINDS}")


def _zero1_functions(namespace: dict | None) -> dict:
    """The learner's make_shard and zero1_step if written, else the kit's solution's."""
    names = ("make_shard", "zero1_step")
    try:
        return dict(zip(names, require(namespace or {}, *names)))
    except NotAttempted:
        solution = solution_module("zero1")
        return {n: getattr(solution, n) for n in names}


def shard_fully(model: nn.Sequential, device: torch.device) -> None:
    """FSDP2: each block sharded on its own, then the root (the first and last layers)."""
    fully_shard = compat.fsdp2_fully_shard()
    if fully_shard is None:
        raise RuntimeError("this torch has no FSDP2 (fully_shard)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole, as one CPU vector (a DTensor is gathered: every rank calls it)."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).cpu() for p in whole])


def train(kind: str, rank: int, world_size: int, device: torch.device,
          namespace: dict | None = None, steps: int = STEPS) -> dict:
    """Train the MLP `steps` Adam steps one way; record the losses, memory after the first step,
    the collectives of the last step, and the parameters at the end."""
    model = mlp(0).to(device)
    module, step, opt = setup_training(kind, model, device, namespace)
    losses, collectives, traffic, sent, memory = [], {}, {}, None, {}
    with quiet_fsdp2():
        for i in range(steps):
            x, y = rank_batch(i, rank, world_size, device)

            def one_step(x=x, y=y):
                loss = F.cross_entropy(module(x), y)
                loss.backward()
                step()
                losses.append(loss.item())

            if i == steps - 1:  # the last step, counted (FSDP2 and DDP are in steady state)
                before = bytes_written()
                ledger = record(one_step)
                collectives, traffic = ledger.counts(), ledger.summary()
                sent = None if before is None else bytes_written() - before
            else:
                one_step()
            if i == 0:
                memory = memory_of(model, opt)
            model.zero_grad(set_to_none=False)  # keep the gradients allocated, as a loop would
    return {"kind": kind, "losses": losses, "memory": memory, "collectives": collectives,
            "traffic": traffic, "sent": sent, "params": full_params(model)}


def bytes_written() -> int | None:
    """Bytes this process has written so far (Linux's /proc/self/io `wchar`, all threads).
    Around a step in which the rank prints nothing, that is what gloo wrote to its TCP
    sockets: the bytes the backend really sent, emulated collectives included. None where
    /proc is missing; NCCL's GPU traffic never passes through write(), so it is not seen."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))
    except (OSError, StopIteration):
        return None


@contextlib.contextmanager
def quiet_fsdp2() -> Iterator[None]:
    """Silence FSDP2's warning that the root returned a view: the loss reads the output once,
    with no in-place op, which is the case the warning guards against."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        yield


def fsdp2_status(device: torch.device) -> str:
    """"runs" if FSDP2 shards a layer and runs a backward on this device's mesh; else why not,
    in one line (older torch wants CUDA for fully_shard)."""
    if compat.fsdp2_fully_shard() is None:
        return "this torch has no fully_shard"
    try:
        model = nn.Sequential(nn.Linear(4, 4)).to(device)
        shard_fully(model, device)
        with quiet_fsdp2():
            model(torch.ones(1, 4, device=device)).sum().backward()
    except Exception as e:  # noqa: BLE001 - any refusal means "not here"
        return f"does not run here: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return "runs"


# ---------------------------------------------------------------- comparing the four


def describe_memory(records: list[list[dict]], world_size: int | None = None) -> str:
    """Bytes per rank for each way of training, beside the formula (deterministic); the world
    size is the number of ranks that returned records unless given."""
    world_size = world_size or len(records)
    psi = param_count(mlp())
    expected = formulas(psi, world_size)
    lines = [f"{psi:,} parameters, fp32 Adam, {world_size} ranks; KiB held by each rank "
             "(formula in brackets)"]
    for i, kind in enumerate(records[0]):
        want = expected[kind["kind"].split(" ")[0]]
        for rank, per_rank in enumerate(records):
            mem = per_rank[i]["memory"]
            cells = "  ".join(f"{k} {mem[k] / 1024:.1f} [{want[k] / 1024:.1f}]" for k in want)
            extra = f"  copies {mem['copies'] / 1024:.1f}" if mem["copies"] else ""
            lines.append(f"  {kind['kind']:<14} rank {rank}: {cells}{extra}")
    return "\n".join(lines)


def describe_equivalence(records: list[list[dict]]) -> str:
    """Whether every way ends with DDP's parameters and losses, within the stated tolerance."""
    lines = [f"after {len(records[0][0]['losses'])} Adam steps, against DDP "
             f"(rtol={RTOL:g}, atol={ATOL:g}):"]
    for i, kind in enumerate(records[0][1:], start=1):
        same = all(case("p", r[i]["params"], r[0]["params"], RTOL, ATOL).ok and
                   case("l", r[i]["losses"], r[0]["losses"], RTOL, ATOL).ok for r in records)
        lines.append(f"  {kind['kind']:<14} parameters and every loss equal on every rank: "
                     f"{'yes' if same else 'NO'}")
    return "\n".join(lines)


def largest_difference(records: list[list[dict]]) -> dict[str, float]:
    """The largest |parameter - DDP's| per way of training, over ranks (for the report)."""
    return {kind["kind"]: max(float((r[i]["params"] - r[0]["params"]).abs().max())
                              for r in records) for i, kind in enumerate(records[0])}


# ---------------------------------------------------------------- counting collectives


def ddp_all_reduces(rank: int, world_size: int, device: torch.device,
                    caps_mb: tuple[float, ...] = DDP_CAPS_MB, steps: int = 3) -> list[dict]:
    """For each bucket_cap_mb, the collectives DDP issues in each of `steps` steps."""
    out = []
    for cap in caps_mb:
        ddp = DDP(mlp(0).to(device), device_ids=device_ids(device), bucket_cap_mb=cap)
        per_step = []
        for i in range(steps):
            x, y = rank_batch(i, rank, world_size, device)
            per_step.append(count_collectives(
                lambda x=x, y=y, ddp=ddp: F.cross_entropy(ddp(x), y).backward()))
        out.append({"cap_mb": cap, "per_step": per_step})
    return out


def fsdp2_expected(blocks: int = BLOCKS, reshard_after_forward: bool = True) -> dict[str, int]:
    """FSDP2's collectives per step: forward all-gathers every group (blocks + root); backward
    all-gathers the blocks again if they were resharded after forward (the root never is) and
    reduce-scatters every group's gradients."""
    again = blocks if reshard_after_forward else 0
    return {"all_gather": blocks + 1 + again, "reduce_scatter": blocks + 1}


def fsdp2_per_module(rank: int, world_size: int, device: torch.device) -> list[tuple]:
    """One steady-state FSDP2 step under CommDebugMode, attributed to modules: rows of (module,
    forward all-gathers, backward all-gathers, backward reduce-scatters) for the root and each
    block. A collective counts for the module that was running when it was issued."""
    model = mlp(0).to(device)
    shard_fully(model, device)
    x, y = rank_batch(0, rank, world_size, device)
    mode = compat.comm_debug_mode()()
    with quiet_fsdp2():
        F.cross_entropy(model(x), y).backward()  # step 1: Adam's state, FSDP2's lazy init
        with mode:
            F.cross_entropy(model(x), y).backward()
    root = next(k for k in mode.comm_module_counts if k != "Global" and "." not in k)
    names = [(root, "root (first and last layers)")]
    names += [(f"{root}.{i}", f"block model[{i}]") for i in range(2, 2 + BLOCKS)]
    rows = []
    for fqn, label in names:
        counts = {d: {_short(op): n for op, n in c.items()}
                  for d, c in mode.comm_module_counts.get(fqn, {}).items()}
        fwd, bwd = counts.get("forward", {}), counts.get("backward", {})
        rows.append((label, fwd.get("all_gather", 0), bwd.get("all_gather", 0),
                     bwd.get("reduce_scatter", 0)))
    return rows


def _short(op) -> str:
    name = str(op).split(".")[-1].strip("_").replace("_base", "")
    return {"allgather": "all_gather"}.get(name, name)


def describe_per_module(rows: list[tuple]) -> str:
    """The per-module table of fsdp2_per_module."""
    lines = [f"{'module':<30}{'forward all_gather':>20}{'backward all_gather':>21}"
             f"{'backward reduce_scatter':>25}"]
    lines += [f"{label:<30}{fa:>20}{ba:>21}{br:>25}" for label, fa, ba, br in rows]
    return "\n".join(lines)


def buckets_expected(caps_mb: tuple[float, ...] = DDP_CAPS_MB) -> list[int]:
    """DDP's buckets per cap after its first step, by its rule (lesson 09's make_buckets)."""
    make = solution_module("bucketed_ddp").make_buckets
    return [len(make(mlp(0), cap)) for cap in caps_mb]


def _count_case(label: str, got, want: int) -> Case:
    """An exact count: an int, or a number with no fraction (3.0 is 3); a bool is no count."""
    ok = isinstance(got, numbers.Real) and not isinstance(got, bool) and got == want
    return Case(label, ok, "" if ok else f"got {got!r}, expected {want}")


def _op_name(key) -> str:
    """A collective's name however spelled: "all-gather", "AllGather", "allgather" ->
    "all_gather"; any other name lower-cased, with "_" for "-" and " "."""
    squashed = re.sub(r"[\s_-]", "", str(key).lower())
    return {"allgather": "all_gather", "reducescatter": "reduce_scatter",
            "allreduce": "all_reduce"}.get(squashed, re.sub(r"[\s-]", "_", str(key).lower()))


@exercise_check("fsdp2_collectives", "prediction",
                wrong_answer={"all_gather": BLOCKS + 1, "reduce_scatter": BLOCKS + 1})
def check_fsdp2_collectives(predicted) -> list[Case]:
    """The learner's {"all_gather": n, "reduce_scatter": m} for one FSDP2 step (any spelling of
    the two names; another collective may appear only with a count of 0)."""
    if not isinstance(predicted, Mapping):
        return [Case("the prediction", False, f"got {predicted!r}, expected a dict like "
                                              "{'all_gather': 0, 'reduce_scatter': 0}")]
    given: dict[str, object] = {}
    for key, n in predicted.items():
        if _op_name(key) in given:
            return [Case("the prediction", False, f"{key!r} names {_op_name(key)} a second "
                                                  "time: give each collective once")]
        given[_op_name(key)] = n
    want = fsdp2_expected()
    cases = [_count_case(f"{op} per step", given.get(op), n) for op, n in want.items()]
    return cases + [_count_case(f"{op} per step (FSDP2 calls none)", n, 0)
                    for op, n in given.items() if op not in want]


@exercise_check("ddp_buckets", "prediction", wrong_answer=[5, 3, 1])
def check_ddp_buckets(predicted) -> list[Case]:
    """The learner's all-reduces per step (after the first) for each cap in DDP_CAPS_MB, as a
    list or tuple of counts in the caps' order."""
    want = buckets_expected()
    if not isinstance(predicted, (list, tuple)) or len(predicted) != len(want):
        return [Case("the prediction", False, f"got {predicted!r}, expected a list of "
                                              f"{len(want)} counts, one per cap")]
    return [_count_case(f"bucket_cap_mb={cap:g}", p, w)
            for cap, p, w in zip(DDP_CAPS_MB, predicted, want)]


# ---------------------------------------------------------------- the ZeRO-1 exercise

ZERO1_STEPS = 5
# Against DDP: on 3 ranks gloo sums in another order than a reduce-scatter does, and Adam turns
# that rounding, in a gradient element near zero, into a parameter difference of up to 3.5e-6
# in 5 steps (measured on the lesson's MLP; 0 on 2 ranks). The gradient itself is compared
# to rtol=1e-5, so a wrong scale cannot hide in this tolerance.
ZERO1_ATOL = 2e-5


def odd_model(seed: int = 0) -> nn.Sequential:
    """Linear(32, 3) + ReLU + Linear(3, 10): 139 parameters, a prime, so that no world size
    divides them and the last rank's slice is padded (55,050 divides by 2, 3 and 5)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 3), nn.ReLU(), nn.Linear(3, CLASSES))


ZERO1_MODELS = (("the lesson's MLP", mlp), ("a 139-parameter model", odd_model))


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])


def _zero1_run(build, make_shard, zero1_step, rank: int, world_size: int,
               device: torch.device) -> dict:
    """ZERO1_STEPS Adam steps of the learner's ZeRO-1 on build(): the shard make_shard made,
    the final parameters, the optimizer's state bytes, and for the last step the collectives
    zero1_step called, where optimizer.step() came among them, the gradient it stepped with
    and the mean gradient it should have been (summed here, outside the ledger). In the last
    step rank 0 calls zero1_step after the others returned (races.rank_zero_last), so a
    reduction started with async_op=True and stepped on before wait() FAILs every run."""
    from ..ledger import Ledger
    from ..races import agreed_key, rank_zero_last

    model = build().to(device)
    shard = make_shard(model)
    opt = torch.optim.Adam([shard], lr=LR)
    seen: dict = {"ledger": None, "steps": [], "grads": []}

    def at_step(optimizer, *_):  # where among the collectives, and with which gradient
        if seen["ledger"] is not None:
            seen["steps"].append(len(seen["ledger"].calls))
            g = optimizer.param_groups[0]["params"][0].grad
            seen["grads"].append(None if g is None else g.detach().clone())

    opt.register_step_pre_hook(at_step)
    for i in range(ZERO1_STEPS):
        x, y = rank_batch(i, rank, world_size, device)
        F.cross_entropy(model(x), y).backward()
        if i < ZERO1_STEPS - 1:
            zero1_step(model, shard, opt)
        else:
            mean = _flat_grads(model).clone()
            dist.all_reduce(mean)
            mean /= world_size
            key = agreed_key("zero1", device)
            with Ledger() as seen["ledger"]:  # rank 0 last: an un-waited reduction FAILs always
                rank_zero_last(key, lambda: zero1_step(model, shard, opt), lambda _: None)
        model.zero_grad(set_to_none=False)
    return {"params": full_params(model), "mean_grad": mean.cpu(),
            "optimizer": memory_of(model, opt)["optimizer"], "calls": seen["ledger"].calls,
            "steps": seen["steps"], "grads": seen["grads"]}


def _ddp_params(build, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """The reference: DDP and Adam on build(), the same batches, ZERO1_STEPS steps."""
    model = build().to(device)
    ddp = DDP(model, device_ids=device_ids(device))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for i in range(ZERO1_STEPS):
        x, y = rank_batch(i, rank, world_size, device)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return full_params(model)


def _slice_case(label: str, got, whole: torch.Tensor, rank: int, size: int,
                rtol: float = 0, atol: float = 0) -> Case:
    """got against this rank's `size` elements of `whole` padded to size x world: the shape
    padded, the values those of `whole` (the padding's values are the learner's to choose)."""
    if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.numel() != size:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return Case(label, False, f"got {shape}, expected ({size},): ceil(parameters / ranks) "
                                  "elements, the last rank's padded")
    real = max(0, min(size, whole.numel() - rank * size))
    return case(label, got.detach().cpu()[:real], whole[rank * size:rank * size + real], rtol,
                atol)


def _after_step_ok(calls, world_size: int, size: int) -> bool:
    """One all_gather of this rank's slice, or one broadcast of a slice per rank."""
    ops, nbytes = [c.op for c in calls], [c.nbytes for c in calls]
    return (ops == ["all_gather"] and nbytes == [4 * size]) or \
        (ops == ["broadcast"] * world_size and nbytes == [4 * size] * world_size)


def _zero1_cases(label: str, build, make_shard, zero1_step, rank: int, world_size: int,
                 device: torch.device) -> list[Case]:
    whole = full_params(build())
    size = -(-whole.numel() // world_size)
    named = f"{label} ({whole.numel():,} parameters, {world_size} ranks)"
    cases = [_slice_case(f"{named}: make_shard(model): this rank's slice",
                         make_shard(build().to(device)), whole, rank, size)]
    try:  # every rank runs the same code, so an answer that raises raises on every rank
        run = _zero1_run(build, make_shard, zero1_step, rank, world_size, device)
    except Exception as e:  # noqa: BLE001 - a crash is a wrong answer: name the case
        first = (str(e).splitlines() or [""])[0]
        return cases + [Case(f"{named}: {ZERO1_STEPS} steps of zero1_step", False,
                             f"raised {type(e).__name__}: {first}")]
    state, want = run["optimizer"], 8 * size  # exp_avg and exp_avg_sq, float32
    cases.append(Case(f"{named}: Adam state of the optimizer zero1_step is given", state == want,
                      "" if state == want else f"got {state:,} bytes, expected {want:,}: "
                      f"exp_avg and exp_avg_sq of this rank's {size} elements only"))
    steps, calls = run["steps"], run["calls"]
    cases.append(case(f"{named}: optimizer.step() calls in one zero1_step", len(steps), 1))
    if len(steps) == 1:
        cases += _mechanism_cases(named, run, calls[:steps[0]], calls[steps[0]:], rank,
                                  world_size, size)
    cases.append(case(f"{named}: parameters after {ZERO1_STEPS} Adam steps, against DDP",
                      run["params"], _ddp_params(build, rank, world_size, device),
                      RTOL, ZERO1_ATOL))
    return cases


def _mechanism_cases(named: str, run: dict, before: list, after: list, rank: int,
                     world_size: int, size: int) -> list[Case]:
    """The gradient the optimizer stepped with, and the collectives on either side of it."""
    label = f"{named}: the gradient optimizer.step() saw: this rank's slice of the mean over " \
        "the ranks"
    if not bool(torch.isfinite(run["mean_grad"]).all()):  # nothing to compare it with
        cases = [Case(label, False, "the model's gradients held NaN or inf in the last step: "
                                    "zero1_step put non-finite values into the parameters")]
    else:
        cases = [_slice_case(label, run["grads"][0], run["mean_grad"], rank, size, RTOL, 1e-7)]
    ok = bool(before) and {c.op for c in before} <= {"reduce_scatter", "all_reduce"}
    cases.append(Case(f"{named}: collectives before optimizer.step()", ok, "" if ok else
                      f"called {_texts(before)}; expected the gradients summed over the "
                      "ranks first: a reduce_scatter (or an all_reduce)"))
    ok = _after_step_ok(after, world_size, size)
    cases.append(Case(f"{named}: collectives after optimizer.step()", ok, "" if ok else
                      f"called {_texts(after)}; expected one all_gather of float32[{size}] (each "
                      "rank's updated slice), or one broadcast of a slice from each rank"))
    return cases


def _texts(calls) -> str:
    return ", ".join(c.text() for c in calls) or "no collective"


@exercise_check("zero1", "ranks")
def check_zero1(namespace: dict) -> list[Case]:
    """make_shard and zero1_step on the lesson's MLP and on a 139-parameter model (no world
    size divides it): the right slice, Adam state for it alone, the gradient stepped with the
    slice of the mean, DDP's parameters after 5 steps, and on the ledger the mechanism: the
    gradients reduced (reduce_scatter or all_reduce) before optimizer.step(), the updated
    slices shared (all_gather, or a broadcast from each rank) after it."""
    make_shard, zero1_step = require(namespace, "make_shard", "zero1_step")
    # The group this check runs in, not the notebook's variables: it may run at another size.
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), namespace["device"]
    # Every rank runs both models whatever its own verdict: a rank that stopped early would
    # leave the others waiting in the next model's collectives.
    return [c for label, build in ZERO1_MODELS
            for c in _zero1_cases(label, build, make_shard, zero1_step, rank, world_size,
                                  device)]


# ---------------------------------------------------------------- compression hooks

HOOKS = ("none", "fp16", "powersgd rank 1", "powersgd rank 4")
COMPRESS_STEPS, COMPRESS_LR, COMPRESS_BATCH = 60, 3e-3, 32  # per rank; Adam


def register_hook(ddp: DDP, name: str) -> None:
    """DDP comm hook by name: "none" (plain fp32 all-reduce, as DDP's default), "fp16",
    "bf16", or "powersgd rank R" (low-rank, with error feedback, after 2 plain steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name.startswith("powersgd rank "):
        state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2,
                                            matrix_approximation_rank=int(name.split()[-1]))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    hooks = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    ddp.register_comm_hook(None, hooks[name])


@contextlib.contextmanager
def all_reduce_bytes() -> Iterator[list[int]]:
    """Record the bytes of every dist.all_reduce called from Python (the comm hooks' calls).
    Not the plain ledger: PowerSGD issues its P and Q all-reduces from inside a future's
    callback, which often runs on gloo's thread, out of a dispatch mode's sight (lesson 10);
    a tapped ledger, `Ledger(tap=True)`, would see them too."""
    sent, original = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield sent
    finally:
        dist.all_reduce = original


def compressed_training(hook: str, rank: int, world_size: int, device: torch.device,
                        steps: int = COMPRESS_STEPS) -> dict:
    """Adam for a fixed number of steps through one comm hook: the bytes this rank put into
    all-reduces, the losses, and the accuracy on 2,000 held-out samples."""
    ddp = DDP(mlp(0).to(device), device_ids=device_ids(device))
    register_hook(ddp, hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=COMPRESS_LR)
    losses, calls = [], []
    with all_reduce_bytes() as sent:
        for i in range(steps):
            x, y = rank_batch(i, rank, world_size, device, size=COMPRESS_BATCH)
            opt.zero_grad()
            before = len(sent)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            calls.append(len(sent) - before)
    x, y = samples(7, 2000)
    with torch.no_grad():
        accuracy = (ddp.module(x.to(device)).argmax(dim=1).cpu() == y).float().mean().item()
    return {"hook": hook, "losses": losses, "accuracy": accuracy, "bytes": sum(sent),
            "calls": calls, "params": full_params(ddp.module)}


def powersgd_ledgers(rank: int, world_size: int, device: torch.device,
                     steps: int = 20) -> dict[str, int]:
    """PowerSGD (rank 1) for 2 plain steps and then `steps`: in how many of those the plain
    Ledger, the tapped one, and a count of dist.all_reduce calls saw all three all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from ..ledger import Ledger

    ddp = DDP(mlp(0).to(device), device_ids=device_ids(device))
    ddp.register_comm_hook(powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2),
        powerSGD_hook.powerSGD_hook)
    seen = {"plain ledger": 0, "tapped ledger": 0, "dist.all_reduce": 0}
    for i in range(2 + steps):
        x, y = rank_batch(i, rank, world_size, device)
        with Ledger() as plain, Ledger(tap=True) as tapped, all_reduce_bytes() as sent:
            F.cross_entropy(ddp(x), y).backward()
        if i >= 2:
            seen["plain ledger"] += plain.counts().get("all_reduce", 0) == 3
            seen["tapped ledger"] += tapped.counts().get("all_reduce", 0) == 3
            seen["dist.all_reduce"] += len(sent) == 3
    return seen


def describe_longer(short: list[list[dict]], longer: list[list[dict]]) -> str:
    """For each hook run at both budgets: its accuracy gap to uncompressed after each, and
    whether the longer budget narrowed it (rank 0; every rank holds the same model)."""
    def gaps(runs):
        base = next(r["accuracy"] for r in runs[0] if r["hook"] == "none")
        return {r["hook"]: base - r["accuracy"] for r in runs[0] if r["hook"] != "none"}
    before, after = gaps(short), gaps(longer)
    n_short, n_long = len(short[0][0]["losses"]), len(longer[0][0]["losses"])
    return "\n".join(f"  {hook:<16} behind uncompressed by less after {n_long} steps than "
                      f"after {n_short}: {'yes' if after[hook] < before[hook] else 'no'}"
                      for hook in after if hook in before)


def hook_status(hook: str, device: torch.device) -> str:
    """"ran" if DDP with `hook` runs a backward on this backend; else the first words of the
    refusal."""
    ddp = DDP(mlp(0).to(device), device_ids=device_ids(device))
    register_hook(ddp, hook)
    x, y = rank_batch(0, 0, 1, device)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except Exception as e:  # noqa: BLE001 - any refusal is what we show
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return "ran"


# ---------------------------------------------------------------- what the notebook prints


def describe_collectives(runs: list[list[dict]]) -> str:
    """The collectives of one (steady-state) step for each way of training, with the bytes
    each rank handed to them (the ledger), and whether every rank counted the same."""
    same = all(r[i]["traffic"] == runs[0][i]["traffic"] for r in runs for i in range(len(r)))
    lines = [f"collectives in one step (KiB this rank handed in), the same on every rank: "
             f"{'yes' if same else 'NO'}"]
    for first in runs[0]:
        calls = ", ".join(f"{op} x{n} ({b / 1024:.1f} KiB)" for op, (n, b)
                          in first["traffic"].items())
        lines.append(f"  {first['kind']:<14} {calls}")
    return "\n".join(lines)


def describe_sent(runs: list[list[dict]], exact: bool = False) -> str:
    """Bytes each rank wrote to its sockets in that step (bytes_written) with `exact`, else only
    the ratio to DDP's, rounded so that a few bytes of message headers cannot change it."""
    what = "bytes" if exact else "against DDP's bytes"
    lines = [f"each rank's socket writes in that step (what gloo sent), {what}:"]
    base = [r[0]["sent"] for r in runs]
    if None not in base and not exact and min(base) < 1024:
        # NCCL's traffic goes GPU to GPU or through shared memory, never through write():
        # a ratio to DDP's few header bytes would be noise, or a division by zero.
        lines.append(f"  not measurable here: DDP's step wrote {min(base):,} B to sockets "
                     "(on NCCL the traffic does not pass through this process's socket writes)")
        return "\n".join(lines)
    for i, first in enumerate(runs[0]):
        sent = [r[i]["sent"] for r in runs]
        if None in sent + base:
            lines.append(f"  {first['kind']:<14} not measurable here (no /proc/self/io)")
            continue
        cells = "  ".join(f"rank {k} " + (f"{s:>9,} B" if exact else f"{s / b:.1f}x")
                          for k, (s, b) in enumerate(zip(sent, base)))
        lines.append(f"  {first['kind']:<14} {cells}")
    return "\n".join(lines)


def describe_ddp_counts(records: list[list[dict]]) -> str:
    """DDP's collectives per step for each bucket cap, from rank 0, with the ranks' agreement."""
    same = all(r == records[0] for r in records)
    lines = [f"DDP, collectives in steps 1, 2, 3 (same on every rank: {'yes' if same else 'NO'})"]
    for row in records[0]:
        steps = "; ".join(", ".join(f"{op} x{n}" for op, n in c.items()) for c in row["per_step"])
        lines.append(f"  bucket_cap_mb={row['cap_mb']:<5g} {steps}")
    return "\n".join(lines)


def describe_bytes(runs: list[list[dict]]) -> str:
    """Bytes each rank put into all-reduces over the budget, per hook (deterministic)."""
    base = runs[0][0]["bytes"]
    same = all(r[i]["bytes"] == runs[0][i]["bytes"] for r in runs for i in range(len(r)))
    lines = [f"bytes all-reduced by each rank in {len(runs[0][0]['losses'])} steps "
             f"(the same on every rank: {'yes' if same else 'NO'})"]
    lines += [f"  {r['hook']:<16} {r['bytes']:>11,} B  ({r['bytes'] / base:.3f} of fp32), "
              f"all-reduce calls in the first step {r['calls'][0]}, in the last {r['calls'][-1]}"
              for r in runs[0]]
    return "\n".join(lines)


def describe_accuracy(runs: list[list[dict]]) -> str:
    """Held-out accuracy after the budget, per hook (rank 0; every rank holds the same model)."""
    return "\n".join(f"  {r['hook']:<16} accuracy {r['accuracy']:.3f}, last loss (rank 0) "
                      f"{r['losses'][-1]:.3f}" for r in runs[0])


def accuracy_within(runs: list[list[dict]], points: float = 0.03) -> str:
    """Which hooks end within `points` of the uncompressed run's accuracy (a stable summary)."""
    base = runs[0][0]["accuracy"]
    return "\n".join(f"  {r['hook']:<16} within {points * 100:g} points of uncompressed: "
                      f"{'yes' if abs(r['accuracy'] - base) <= points else 'no'}"
                      for r in runs[0][1:])
