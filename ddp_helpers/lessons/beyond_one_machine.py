"""Lesson 08: one training function that runs unchanged under dh.launch, under `torchrun`, and as
two torchrun "nodes" that meet through c10d rendezvous; a killed rank that torchrun restarts and
that resumes from the checkpoint; and the Slurm scripts in examples/, tested without Slurm.

`train` writes what it did to files instead of only returning it, because torchrun's workers have
no parent to return to: per-rank JSON Lines records (one line per step) and an atomic checkpoint
every `ckpt_every` steps, from which a restarted group resumes. The data order is a function of
(seed, step) alone, so a resumed run sees exactly the batches the interrupted one would have.

    torchrun --nproc-per-node 2 -m ddp_helpers.lessons.beyond_one_machine --out DIR --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from ddp_helpers.checks import Case, case
from ddp_helpers.exercises import exercise_check, require
from ddp_helpers.models import flat_params
from ddp_helpers.runtime import device_ids, process_group
from ddp_helpers.torchrun import readable, torchrun_agents  # noqa: F401 - the notebook's torchrun

N_SAMPLES, N_FEATURES, N_CLASSES = 1024, 8, 4
GLOBAL_BATCH = 64  # split evenly over the ranks, so 1, 2 or 4 ranks take the same steps
CHECKPOINT = "checkpoint.pt"
FINAL = "final.pt"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm_torchrun.sh"

# ---------------------------------------------------------------- data, model, data order


def make_dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic classification set: 1024 points in 8-D, 4 classes from a random teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(N_SAMPLES, N_CLASSES, generator=g)).argmax(dim=1)
    return x, y


def make_model(seed: int = 0) -> nn.Module:
    """A tiny MLP, initialised from the seed: the same weights on every rank and every run."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_FEATURES, 32), nn.ReLU(), nn.Linear(32, N_CLASSES))


def batch_indices(step: int, rank: int, world_size: int, seed: int = 0) -> torch.Tensor:
    """The sample indices rank `rank` trains on at `step` (1-based): a function of the step only."""
    per_epoch = N_SAMPLES // GLOBAL_BATCH
    epoch, b = divmod(step - 1, per_epoch)
    # A fresh generator per epoch instead of one running RNG: nothing to save in the checkpoint,
    # and a run resumed at any step draws the same permutation.
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
    batch = perm[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]
    return batch[rank::world_size]  # interleaved, like DistributedSampler: disjoint shards


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """Write a checkpoint atomically: a temporary file in the same directory, then os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # A kill at any moment leaves either the old checkpoint or the new one, never half of one.
    os.replace(tmp, path)


def load_checkpoint(out_dir: str | os.PathLike) -> dict | None:
    """The last checkpoint in out_dir, or None when there is none yet."""
    path = Path(out_dir) / CHECKPOINT
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- the training function


def train(rank: int, world_size: int, out_dir: str, steps: int = 30, ckpt_every: int = 5,
          fault_step: int | None = None, fault_rank: int = 1, seed: int = 0,
          backend: str = "auto") -> dict:
    """Train the tiny MLP with DDP for `steps` steps, resuming from out_dir's checkpoint if any."""
    if fault_step is not None and not 1 <= fault_step <= steps:
        raise ValueError(f"rank {rank}: fault_step={fault_step} is outside steps 1..{steps}; "
                         "pick a step inside the run, or None for no fault.")
    # The same arithmetic under any launcher (torchrun sets 1 thread only for 2+ workers a node).
    torch.set_num_threads(1)
    # torchrun counts its agent's restarts; under dh.launch there are none, so attempt 0.
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(out_dir)
    (out / "records").mkdir(parents=True, exist_ok=True)
    # The device comes from LOCAL_RANK (this machine's worker number), never from the global
    # rank: on a second node rank 2 is that node's cuda:0.
    with process_group(rank, world_size, backend=backend, verbose=False) as device:
        x, y = make_dataset(seed)
        model = make_model(seed).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # Every rank loads the checkpoint itself: each keeps its own copy of the optimizer state
        # (identical across ranks, built from the same averaged gradients) and DDP broadcasts
        # parameters and buffers only, never it. Loading before DDP's first broadcast keeps ranks
        # in step.
        ckpt = load_checkpoint(out)
        start = 0
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            start = ckpt["step"]
        ddp = DistributedDataParallel(model, device_ids=device_ids(device))
        if rank == 0:
            _say_where_we_start(out, attempt, start, ckpt_every)
        losses = []
        with open(out / "records" / f"rank{rank}.attempt{attempt}.jsonl", "w") as log:
            _write(log, {"event": "start", "rank": rank, "world_size": world_size,
                         "attempt": attempt, "resumed_from": start, "device": str(device),
                         "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
                         "group_rank": int(os.environ.get("GROUP_RANK", "0"))})
            for step in range(start + 1, steps + 1):
                if step == fault_step and attempt == 0:
                    _fail(rank, fault_rank, step)
                idx = batch_indices(step, rank, world_size, seed)
                loss = nn.functional.cross_entropy(ddp(x[idx].to(device)), y[idx].to(device))
                opt.zero_grad()
                loss.backward()  # DDP averages the gradients over the ranks here
                opt.step()
                losses.append(loss.item())
                _write(log, {"event": "step", "step": step, "loss": losses[-1]})
                if rank == 0 and (step % ckpt_every == 0 or step == steps):
                    save_checkpoint({"step": step, "model": model.state_dict(),
                                     "optimizer": opt.state_dict()}, out / CHECKPOINT)
        params = flat_params(model)
        if rank == 0:
            save_checkpoint({"step": steps, "params": params}, out / FINAL)
        return {"rank": rank, "attempt": attempt, "resumed_from": start, "losses": losses,
                "params": params}


def _write(log, rec: dict) -> None:
    # One line per step, flushed: a rank killed mid-run keeps every line it wrote before.
    log.write(json.dumps(rec) + "\n")
    log.flush()


def _say_where_we_start(out: Path, attempt: int, start: int, ckpt_every: int) -> None:
    if start == 0:
        print(f"attempt {attempt}: starting from step 0 (no checkpoint)", flush=True)
        return
    before = _last_step(out / "records" / f"rank0.attempt{attempt - 1}.jsonl")
    redone = max(0, before - start)
    print(f"attempt {attempt}: resumed from the checkpoint of step {start}; the last attempt "
          f"reached step {before}, so {redone} step(s) are redone (checkpoint interval "
          f"{ckpt_every})", flush=True)


def _fail(rank: int, fault_rank: int, step: int) -> None:
    # The barrier makes the lesson's numbers reproducible: every rank has finished step - 1
    # (and written its record) before the kill, however the two cores are scheduled.
    dist.barrier()
    if rank == fault_rank:
        print(f"rank {rank}: killed with SIGKILL at step {step} (attempt 0)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # like a crash or an OOM kill: no clean-up runs


def _last_step(path: Path) -> int:
    if not path.exists():
        return 0
    steps = [r["step"] for r in map(json.loads, path.read_text().splitlines())
             if r.get("event") == "step"]
    return max(steps, default=0)


# ---------------------------------------------------------------- parent side: read the files


def collect(out_dir: str | os.PathLike) -> list[dict]:
    """Every rank's records of every attempt, sorted by (attempt, rank)."""
    records = []
    for path in sorted(Path(out_dir, "records").glob("rank*.attempt*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        start = next(r for r in lines if r["event"] == "start")
        steps = [r for r in lines if r["event"] == "step"]
        records.append({**{k: v for k, v in start.items() if k != "event"},
                        "steps": [r["step"] for r in steps],
                        "loss": [r["loss"] for r in steps]})
    if not records:
        raise FileNotFoundError(f"no records under {out_dir}/records: did the run start? Look at "
                                "its output (torchrun prints each worker's error).")
    return sorted(records, key=lambda r: (r["attempt"], r["rank"]))


def loss_by_rank(records: list[dict]) -> dict[int, list[float]]:
    """Each rank's loss per step, the latest attempt winning where a step was redone."""
    by_rank: dict[int, dict[int, float]] = {}
    for rec in sorted(records, key=lambda r: r["attempt"]):
        by_rank.setdefault(rec["rank"], {}).update(zip(rec["steps"], rec["loss"]))
    return {r: [d[s] for s in sorted(d)] for r, d in sorted(by_rank.items())}


def restart_summary(records: list[dict]) -> dict:
    """Per attempt: the step it resumed from and the last step it reached; and the steps redone."""
    attempts = {}
    for rec in records:
        a = attempts.setdefault(rec["attempt"], {"resumed_from": rec["resumed_from"],
                                                 "last_step": 0})
        a["last_step"] = max([a["last_step"], *rec["steps"]])
    redone = sum(max(0, attempts[a - 1]["last_step"] - attempts[a]["resumed_from"])
                 for a in attempts if a > 0)
    return {"attempts": attempts, "steps_redone": redone}


def final_params(out_dir: str | os.PathLike) -> torch.Tensor:
    """The flat parameters rank 0 saved at the end of a run."""
    return torch.load(Path(out_dir) / FINAL, map_location="cpu", weights_only=True)["params"]


# ---------------------------------------------------------------- served ranks: %%ranks on torchrun


def served_agents(pool, nnodes: int = 2, nproc_per_node: int = 1,
                  log_dir: str | os.PathLike | None = None,
                  envs: list[dict] | None = None, max_restarts: int = 0
                  ) -> list[subprocess.Popen]:
    """Start `nnodes` torchrun agents on this machine, as many "nodes" meeting through c10d on
    loopback, whose workers are `python -m ddp_helpers.serve` ranks attached to `pool` (a
    dh.Ranks.listen pool, or the one `pool = %ranks listen N` returned). `envs[n]` is added to agent
    n's environment (e.g. its own CUDA_VISIBLE_DEVICES). Each agent's output goes to
    agent<N>.log in `log_dir` (a temporary folder by default). With `max_restarts`, torchrun
    restarts a failed group that many times (the fresh workers attach to the same pool).
    Returns the agents; they end when the pool stops."""
    from ddp_helpers import free_port

    envs = envs or [{}] * nnodes

    logs = Path(log_dir or tempfile.mkdtemp(prefix="served_agents_"))
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(logs / f"tr{node}"),
               "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
               "--max-restarts", str(max_restarts),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "served",
               "-m", "ddp_helpers.serve", "--connect", pool.address,
               "--token-file", pool.token_file]
        with open(logs / f"agent{node}.log", "w") as log:
            agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **envs[node]},
                                           start_new_session=True))
    return agents


def agents_ended(agents: list[subprocess.Popen], timeout: float = 60) -> list[int | None]:
    """Each agent's exit code once it ends (None: still running after `timeout`, then killed:
    a served rank must never outlive its pool)."""
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
            codes.append(None)
    return codes


# ---------------------------------------------------------------- the command line torchrun runs


@record  # an exception is written to $TORCHELASTIC_ERROR_FILE, for torchrun's failure report
def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun: rank and world size come from the environment it sets."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.lessons.beyond_one_machine",
                                description="Lesson 08's training run; start it with torchrun.")
    p.add_argument("--out", required=True, help="directory for records and checkpoints")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--fault-step", type=int, default=None,
                   help="on the first attempt, kill --fault-rank with SIGKILL at this step")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        p.error(f"{', '.join(missing)} not set: this module is what each worker runs. Start it "
                "with `torchrun --nproc-per-node 2 -m ddp_helpers.lessons.beyond_one_machine "
                "--out DIR`, or call train() through ddp_helpers.launch.")
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.out, args.steps,
          args.ckpt_every, args.fault_step, args.fault_rank, args.seed, args.backend)
    return 0


# ---------------------------------------------------------------- Slurm, without Slurm


def srun_env(job: str, nodelist: str, hosts: list[str], node: int, gpus: int | None = None,
             **extra: str) -> tuple[dict[str, str], list[str]]:
    """What `srun --ntasks-per-node=1` sets on node `node` of a job on `hosts`, and what
    `scontrol show hostnames` prints there: the variables a learner might reach for too
    (SLURM_NTASKS counts tasks, not GPUs; SLURMD_NODENAME is this node, not the first)."""
    n = str(len(hosts))
    env = {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": n, "SLURM_NNODES": n,
           "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
           "SLURM_NTASKS": n, "SLURM_NTASKS_PER_NODE": "1", "SLURMD_NODENAME": hosts[node]}
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return {**env, **extra}, hosts


# Fake allocations: both nodes of a two-node job; node 2 of four, from a node list with ranges;
# a mixed list of three; one CPU node with MASTER_PORT set.
ALLOCATIONS = [
    srun_env("4242", "gpu[07-08]", ["gpu07", "gpu08"], 0, gpus=2),
    srun_env("4242", "gpu[07-08]", ["gpu07", "gpu08"], 1, gpus=2),
    srun_env("918273", "a100-[3,5,9-10]", ["a100-3", "a100-5", "a100-9", "a100-10"], 2, gpus=8),
    srun_env("5150", "node[001-002],bigmem03", ["node001", "node002", "bigmem03"], 1, gpus=4),
    srun_env("77", "cpu01", ["cpu01"], 0, MASTER_PORT="12345"),
]
_OURS = ("MASTER_PORT", "NPROC_PER_NODE", "TORCHRUN", "MAX_RESTARTS", "DRY_RUN")


def slurm_torchrun_command(env: dict[str, str], hostnames: list[str]) -> list[str]:
    """The torchrun command slurm_torchrun.sh builds on a node with these Slurm variables, found
    by running the script itself with DRY_RUN=1 and a fake `scontrol`."""
    with tempfile.TemporaryDirectory() as bin_dir:
        scontrol = Path(bin_dir, "scontrol")  # prints the node list, as the real one would
        scontrol.write_text("#!/bin/sh\nprintf '%s\\n' "
                            + " ".join(shlex.quote(h) for h in hostnames) + "\n")
        scontrol.chmod(0o755)
        full = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in _OURS}
        full.update(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", DRY_RUN="1")
        p = subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True,
                           timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} failed with exit code {p.returncode}: "
                           f"{p.stderr.strip()}")
    return p.stdout.split()


def flags(command: list[str]) -> dict[str, str]:
    """The --flag value pairs of a command line, as a dict."""
    return {a: b for a, b in zip(command, command[1:]) if a.startswith("--")}


# torchrun reads these only with --rdzv-backend static (run.py warns that it ignores them):
# under c10d they change nothing, so an answer may give them or not.
STATIC_ONLY = ("node_rank", "master_addr", "master_port")


def torchrun_args(argv: list[str]) -> tuple[dict, dict[str, tuple[str, object]], set[str]]:
    """argv parsed by torchrun's own parser, so that every spelling torchrun accepts counts the
    same (--rdzv_id or --rdzv-id, --nnodes=2 or --nnodes 2 or 2:2): {dest: value}, {dest: (its
    flag, torchrun's default)}, and the dests argv gave."""
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    parser = get_args_parser()

    def refuse(message: str):
        raise ValueError(f"torchrun would refuse these flags: {message}")

    parser.error = refuse  # argparse would print usage and exit the kernel
    named = {a.dest: (a.option_strings[0], a.default) for a in parser._actions
             if a.option_strings}
    unset = object()
    parser.set_defaults(**dict.fromkeys(named, unset))  # to tell a flag given from one left out
    parsed = vars(parser.parse_args([*argv, "train.py"]))
    given = {dest for dest, value in parsed.items() if value is not unset}
    parsed.update({dest: named[dest][1] for dest in named if dest not in given})
    low, high = parse_min_max_nnodes(str(parsed["nnodes"]))  # "2" and "2:2": one fixed size
    parsed["nnodes"] = str(low) if low == high else f"{low}:{high}"
    named["nnodes"] = ("--nnodes", "1")
    return parsed, named, given


def as_argv(answer) -> list[str]:
    """A dict of flags ({"--nnodes": 2, "rdzv_id": ...}) or a list of arguments, as argv."""
    if isinstance(answer, (list, tuple)):
        return [str(a) for a in answer]
    argv = []
    for flag, value in answer.items():
        flag = str(flag) if str(flag).startswith("-") else f"--{flag}"
        if value is True:
            argv.append(flag)  # a switch, such as --standalone
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def flag_differences(answer, command: list[str]) -> list[str]:
    """What torchrun would do differently with `answer`'s flags than with `command`'s."""
    want, named, _ = torchrun_args(command[1:])
    got, _, given = torchrun_args(as_argv(answer))
    wrong = []
    for dest, value in want.items():
        if dest in STATIC_ONLY or got[dest] == value:
            continue
        flag, default = named.get(dest, (dest, None))
        if dest not in given:
            wrong.append(f"{flag} is missing (torchrun's default: {default!r}), the script gives "
                         f"{value!r}")
        elif value == default:
            wrong.append(f"{flag} is {got[dest]!r}, the script leaves torchrun's default "
                         f"{value!r}")
        else:
            wrong.append(f"{flag} is {got[dest]!r}, the script gives {value!r}")
    return wrong


def torchrun_flag_cases(fn: Callable[[dict, list[str]], dict[str, str]]) -> list[Case]:
    """One case per fake allocation: fn(env, hostnames)'s flags, read by torchrun's parser,
    against the flags the script itself gives torchrun there."""
    cases = []
    for env, hosts in ALLOCATIONS:
        name = (f"job {env['SLURM_JOB_ID']} on {env['SLURM_JOB_NODELIST']}, node "
                f"{env['SLURM_NODEID']} of {env['SLURM_JOB_NUM_NODES']}")
        command = slurm_torchrun_command(env, hosts)
        try:
            got = fn(dict(env), list(hosts))
            if not isinstance(got, (dict, list, tuple)):
                cases.append(Case(name, False, f"got {got!r}, expected a dict of flags"))
                continue
            wrong = flag_differences(got, command)
        except Exception as e:  # noqa: BLE001 - a crash on one allocation names that one
            wrong = [f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"]
        cases.append(Case(name, not wrong, "; ".join(wrong)))
    return cases


# ---------------------------------------------------------------- exercises


@exercise_check("torchrun_flags_from_slurm", "file")
def check_torchrun_flags_from_slurm(module) -> list:
    """The learner's flags against examples/slurm_torchrun.sh's, for five fake allocations (up
    to four nodes, compressed node lists, a node other than the first), read as torchrun reads
    them: any spelling it accepts is the same flag."""
    return torchrun_flag_cases(require(module, "torchrun_flags_from_slurm"))


# (fault step, checkpoint interval) -> steps redone; tests/test_lesson_beyond_one_machine.py
# measures each with a real killed-and-relaunched run.
REDONE = {(13, 5): 2, (7, 4): 2, (11, 5): 0, (10, 5): 4, (3, 10): 2}


@exercise_check("steps_redone", "file")
def check_steps_redone(module) -> list:
    """The learner's formula against the steps measured as redone after a kill."""
    fn = require(module, "steps_redone")
    cases = []
    for (f, k), redone in REDONE.items():
        label = f"killed at step {f}, checkpoint every {k}"
        try:
            cases.append(case(label, fn(f, k), redone, rtol=0, atol=0))
        except Exception as e:  # noqa: BLE001 - a crash on one pair names that pair
            cases.append(Case(label, False, f"raised {type(e).__name__}: {e}"))
    return cases


if __name__ == "__main__":
    sys.exit(main())
