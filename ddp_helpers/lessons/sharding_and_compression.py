"""Lesson 10: past DDP. Where a rank's memory goes (DDP, ZeRO-1, FSDP2), what each sends per step,
and gradient compression with DDP's communication hooks.

Run on persistent ranks (`%%ranks`): every function here takes the rank's `rank, world_size,
device` and returns plain records for the parent to print and plot. The model is a small MLP
of blocks, so FSDP2 has layers to shard one by one; the data are a synthetic classification
task, the same on any machine: a fixed random linear teacher labels Gaussian inputs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

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
            "unsharded parameters then": round(by_name.get("Unsharded Param", 0) / 1024, 1)}


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


def describe_memory(records: list[list[dict]], world_size: int) -> str:
    """Bytes per rank for each way of training, beside the formula (deterministic)."""
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
        F.cross_entropy(model(x), y).backward()  # the first step sets FSDP2's order up
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


@exercise_check("fsdp2_collectives", "prediction",
                wrong_answer={"all_gather": BLOCKS + 1, "reduce_scatter": BLOCKS + 1})
def check_fsdp2_collectives(predicted) -> list[Case]:
    """The learner's {"all_gather": n, "reduce_scatter": m} for one FSDP2 step."""
    if not isinstance(predicted, dict):
        return [Case("the prediction", False, f"got {predicted!r}, expected a dict like "
                                              "{'all_gather': 0, 'reduce_scatter': 0}")]
    want = fsdp2_expected()
    return [case(f"{op} per step", predicted.get(op), n) for op, n in want.items()]


@exercise_check("ddp_buckets", "prediction", wrong_answer=[5, 3, 1])
def check_ddp_buckets(predicted) -> list[Case]:
    """The learner's all-reduces per step (after the first) for each cap in DDP_CAPS_MB."""
    want = buckets_expected()
    if not isinstance(predicted, (list, tuple)) or len(predicted) != len(want):
        return [Case("the prediction", False, f"got {predicted!r}, expected a list of "
                                              f"{len(want)} counts, one per cap")]
    return [case(f"bucket_cap_mb={cap:g}", p, w)
            for cap, p, w in zip(DDP_CAPS_MB, predicted, want)]


# ---------------------------------------------------------------- the ZeRO-1 exercise


@exercise_check("zero1", "ranks")
def check_zero1(namespace: dict) -> list[Case]:
    """make_shard and zero1_step: the right slice, Adam state for it alone, DDP's parameters
    after 5 steps, and one reduce-scatter (or all-reduce) plus one all-gather per step."""
    make_shard, zero1_step = require(namespace, "make_shard", "zero1_step")
    rank, world_size, device = namespace["rank"], namespace["world_size"], namespace["device"]
    flat = full_params(mlp(0))
    size = -(-flat.numel() // world_size)
    want = F.pad(flat, (0, size * world_size - flat.numel()))[rank * size:(rank + 1) * size]
    shard = make_shard(mlp(0).to(device))
    cases = [case("make_shard(model): this rank's slice of the flat parameters", shard, want, 0, 0)]
    namespace_fns = {"make_shard": make_shard, "zero1_step": zero1_step}
    mine = train("zero1 (yours)", rank, world_size, device, namespace_fns, steps=5)
    ddp = train("ddp", rank, world_size, device, steps=5)
    cases.append(case("parameters after 5 Adam steps, against DDP", mine["params"],
                      ddp["params"], RTOL, ATOL))
    state = mine["memory"]["optimizer"]
    cases.append(case("Adam state on this rank (bytes): two tensors of the shard's size",
                      state, 2 * 4 * size))
    sent = mine["collectives"]
    ok = sent in ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "all_reduce": 1})
    cases.append(Case("collectives in a step", ok, "" if ok else
                      f"got {sent}, expected one reduce_scatter (or all_reduce) and one "
                      "all_gather"))
    return cases


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
    Not the ledger: PowerSGD issues its P and Q all-reduces from inside a future's callback,
    and the ledger (a dispatch mode, like CommDebugMode) does not see those (lesson 10 shows
    it: one all-reduce a step on the ledger, three calls of dist.all_reduce)."""
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
    lines = [f"bytes all-reduced by each rank in {COMPRESS_STEPS} steps "
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
