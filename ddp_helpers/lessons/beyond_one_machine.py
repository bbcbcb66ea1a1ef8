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
import re
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
SRUN_TASK = ROOT / "examples" / "slurm_srun_task.sh"

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
    """Write a checkpoint atomically: a temporary file in the same directory, then os.replace.
    Temporary files left by a writer that was killed mid-save are removed first."""
    path = Path(path)
    remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    except BaseException:  # a Python exception; a signal's kill runs no Python at all
        tmp.unlink(missing_ok=True)
        raise
    # A kill at any moment leaves either the old checkpoint or the new one, never half of one.
    os.replace(tmp, path)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove `path`'s temporary files whose writer no longer runs on this machine; return them.

    A writer killed mid-save (torchrun's SIGTERM when another worker fails, a SIGKILL) runs no
    clean-up, so its partly written file, as large as a checkpoint, would stay at every kill."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks that the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
    out = Path(out_dir)
    (out / "records").mkdir(parents=True, exist_ok=True)
    # The device comes from LOCAL_RANK (this machine's worker number), never from the global
    # rank: on a second node rank 2 is that node's cuda:0.
    with process_group(rank, world_size, backend=backend, verbose=False) as device:
        attempt = agreed_attempt(out, device)  # 0, then 1 after a restart, a rerun, a requeue
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


def agreed_attempt(out: Path, device: torch.device) -> int:
    """This attempt's number in `out`: how many attempts rank 0 finds records of. A torchrun
    restart, a rerun of the same command and a requeued Slurm job all count on, where
    TORCHELASTIC_RESTART_COUNT starts again at 0 in every new torchrun. Rank 0 counts and
    broadcasts, so every rank gets the same number."""
    n = torch.tensor([len(list((out / "records").glob("rank0.attempt*.jsonl")))], device=device)
    dist.broadcast(n, src=0)
    return int(n.item())


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


def show_device_choice() -> None:
    """Print the lines of dh.process_group (ddp_helpers/runtime.py) that give a rank its device:
    the local rank from LOCAL_RANK, and on GPUs that local rank's GPU, made current."""
    import inspect

    from ddp_helpers import runtime

    for fn, marks in ((runtime.process_group, ("LOCAL_RANK", "_place_rank(")),
                      (runtime._place_rank, ('torch.device("cuda"', "set_device(", "Before init"))):
        print(f"runtime.py, {fn.__name__}:")
        for line in inspect.getsource(fn).splitlines():
            if any(m in line for m in marks):
                print(f"    {line.strip()}")


def init_with_interface(name: str) -> str:
    """What gloo says when GLOO_SOCKET_IFNAME names an interface: one rank, world size 1."""
    from ddp_helpers import launch

    (said,) = launch(_init_on, args=(name,), nprocs=1, timeout=60, output="none",
                     env={"GLOO_SOCKET_IFNAME": name})
    return said


def _init_on(rank: int, name: str) -> str:
    try:
        with process_group(rank, 1, backend="gloo", verbose=False):
            return f"GLOO_SOCKET_IFNAME={name}: the group started"
    except RuntimeError as e:
        # gloo's message starts with a C++ source path and the failed test ("[enforce fail at
        # .../device.cc:84] ifa != nullptr. "): the sentence after them is the news
        said = re.sub(r"^\S+ != \S+\. ", "", str(e).split("] ")[-1].strip())
        return f"GLOO_SOCKET_IFNAME={name}: {type(e).__name__}: {said}"


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
             tasks_per_node: int = 1, local: int = 0, **extra: str
             ) -> tuple[dict[str, str], list[str]]:
    """What srun sets for task `local` of `tasks_per_node` on node `node` of a job on `hosts`,
    and what `scontrol show hostnames` prints there: the variables a learner might reach for
    too (SLURM_NTASKS counts tasks, not GPUs; SLURMD_NODENAME is this node, not the first;
    SLURM_SUBMIT_HOST is the login node sbatch ran on, not one of the job's)."""
    n = str(len(hosts))
    env = {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": n, "SLURM_NNODES": n,
           "SLURM_NODEID": str(node), "SLURM_PROCID": str(node * tasks_per_node + local),
           "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(len(hosts) * tasks_per_node),
           "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURMD_NODENAME": hosts[node],
           "SLURM_SUBMIT_HOST": "login01"}
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return {**env, **extra}, hosts


# Fake jobs: (job id, node list, what `scontrol show hostnames` prints, GPUs per node): two
# nodes; four from a list with ranges; three from a mixed list; two CPU nodes without GPUs.
JOBS = [
    ("4242", "gpu[07-08]", ["gpu07", "gpu08"], 2),
    ("918273", "a100-[3,5,9-10]", ["a100-3", "a100-5", "a100-9", "a100-10"], 8),
    ("5150", "node[001-002],bigmem03", ["node001", "node002", "bigmem03"], 4),
    ("77", "cpu[01-02]", ["cpu01", "cpu02"], None),
]
_OURS = ("MASTER_PORT", "NPROC_PER_NODE", "TORCHRUN", "MAX_RESTARTS", "DRY_RUN")


def job_nodes(job: str, nodelist: str, hosts: list[str], gpus: int | None
              ) -> list[tuple[dict[str, str], list[str]]]:
    """srun's variables and `scontrol show hostnames` on every node of a fake job."""
    return [srun_env(job, nodelist, hosts, node, gpus) for node in range(len(hosts))]


def slurm_torchrun_command(env: dict[str, str], hostnames: list[str]) -> list[str]:
    """The torchrun command slurm_torchrun.sh builds on a node with these Slurm variables, found
    by running the script itself with DRY_RUN=1 and a fake `scontrol`."""
    return _dry_run(SCRIPT, env, hostnames).split()


def srun_task_env(env: dict[str, str], hostnames: list[str]) -> dict[str, str]:
    """The variables slurm_srun_task.sh gives its python on a task with these Slurm variables
    (the script itself, run with DRY_RUN=1 and a fake `scontrol`)."""
    return dict(line.split("=", 1) for line in _dry_run(SRUN_TASK, env, hostnames).splitlines())


def _fake_scontrol(bin_dir: str, hostnames: list[str]) -> None:
    scontrol = Path(bin_dir, "scontrol")  # prints the node list, as the real one would
    scontrol.write_text("#!/bin/sh\nprintf '%s\\n' "
                        + " ".join(shlex.quote(h) for h in hostnames) + "\n")
    scontrol.chmod(0o755)


def _slurm_env(env: dict[str, str], bin_dir: str) -> dict[str, str]:
    """This process's environment without Slurm's or the scripts' own variables, plus `env`."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in _OURS}
    full.update(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return full


def _dry_run(script: Path, env: dict[str, str], hostnames: list[str]) -> str:
    with tempfile.TemporaryDirectory() as bin_dir:
        _fake_scontrol(bin_dir, hostnames)
        p = subprocess.run(["bash", str(script)], env={**_slurm_env(env, bin_dir), "DRY_RUN": "1"},
                           capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{script.name} failed with exit code {p.returncode}: "
                           f"{p.stderr.strip()}")
    return p.stdout


def srun_tasks(args: list[str], tasks_per_node: int = 2, job: str = "4242",
               timeout: float = 120) -> list[dict]:
    """Run slurm_srun_task.sh on this machine as `srun --ntasks-per-node=N` would on one node:
    N processes at once, each with the variables srun gives a task (SLURM_PROCID, SLURM_LOCALID,
    SLURM_NTASKS, ...) and a fake `scontrol` naming this machine; each runs `python *args`.
    Returns each task's exit code and output, rank-ordered."""
    from ddp_helpers import free_port

    procs = []
    with tempfile.TemporaryDirectory() as bin_dir:
        _fake_scontrol(bin_dir, ["127.0.0.1"])
        n = str(tasks_per_node)
        common = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": n,
                  "SLURM_NTASKS_PER_NODE": n, "SLURM_NODEID": "0", "MASTER_PORT": str(free_port()),
                  "PYTHON": sys.executable}
        for task in range(tasks_per_node):
            env = _slurm_env({**common, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
                             bin_dir)
            procs.append(subprocess.Popen(["bash", str(SRUN_TASK), *args], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        return [_finish(p, timeout) for p in procs]


def _finish(p: subprocess.Popen, timeout: float) -> dict:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hung task: stop it and whatever it started
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
    return {"returncode": p.returncode, "output": readable(out)}


def flags(command: list[str]) -> dict[str, str]:
    """The --flag value pairs of a command line, as a dict."""
    return {a: b for a, b in zip(command, command[1:]) if a.startswith("--")}


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


class Refused(ValueError):
    """torchrun would refuse these flags (its parser, or its endpoint parsing, says why)."""


def torchrun_reads(answer) -> dict:
    """What torchrun makes of an answer's flags: its own parser (every spelling it accepts:
    --rdzv_id or --rdzv-id, --nnodes=2 or 2:2), --standalone rewritten as torch's run() does,
    the endpoint split as the c10d backend splits it (29400 when no port is given)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser, get_rdzv_endpoint, parse_min_max_nnodes

    parser = get_args_parser()

    def refuse(message: str):
        raise Refused(message)

    parser.error = refuse  # argparse would print its usage and exit the kernel
    args = parser.parse_args([*as_argv(answer), "train.py"])
    if args.standalone:  # torch/distributed/run.py run(): one node, its own store
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", "<uuid4>"
    if args.master_port is None:
        args.master_port = 29500  # as run() sets it
    try:
        nnodes = parse_min_max_nnodes(str(args.nnodes))
        endpoint = parse_rendezvous_endpoint(get_rdzv_endpoint(args), default_port=29400)
    except (ValueError, RuntimeError) as e:
        raise Refused(str(e)) from e
    return {"standalone": args.standalone, "backend": args.rdzv_backend, "nnodes": nnodes,
            "nproc": args.nproc_per_node, "endpoint": endpoint, "id": args.rdzv_id,
            "restarts": args.max_restarts}


LOOPBACK = ("localhost", "127.", "::1", "0.0.0.0")


def node_problems(got: dict, hosts: list[str], gpus: int | None) -> list[str]:
    """What keeps one node's flags from working in a fixed job on `hosts`, first things first."""
    if got["standalone"]:
        return ["--standalone: each node's torchrun makes a rendezvous of its own on localhost, "
                "with a random run id, so the nodes never meet (it is for one node)"]
    if got["backend"] != "c10d":
        return [f"--rdzv-backend is {got['backend']!r} (torchrun's default when none is given): "
                "the exercise asks for the c10d rendezvous"]
    problems = []
    low, high = got["nnodes"]
    if (low, high) != (len(hosts), len(hosts)):
        given = str(low) if low == high else f"{low}:{high}"
        elastic = " (MIN:MAX lets the rendezvous start with fewer)" if low != high else ""
        problems.append(f"--nnodes is {given!r}, the job has {len(hosts)} nodes{elastic}")
    problems += nproc_problems(str(got["nproc"]), gpus)
    host, port = got["endpoint"]
    if host.startswith(LOOPBACK):
        problems.append(f"--rdzv-endpoint host {host!r} is every node's own machine: the nodes "
                        "never meet")
    elif host not in hosts:
        problems.append(f"--rdzv-endpoint host {host!r} is not one of the job's nodes "
                        f"({', '.join(hosts)}): the store's host must be one of them")
    if not 1024 <= port <= 65535:
        why = ("asks each host for a free port, which the others cannot know" if port == 0 else
               "needs root" if 0 < port < 1024 else "is not a TCP port (1024 to 65535)")
        problems.append(f"--rdzv-endpoint port {port} {why}")
    if got["restarts"] < 1:
        problems.append(f"--max-restarts is {got['restarts']} (torchrun's default is 0): the "
                        "exercise asks that each agent may restart its workers at least once")
    return problems


def nproc_problems(nproc: str, gpus: int | None) -> list[str]:
    """--nproc-per-node against one worker per GPU (one on a node without GPUs). torchrun turns
    'gpu' and 'auto' into the GPUs it sees, which Slurm limits to the job's
    (CUDA_VISIBLE_DEVICES)."""
    if nproc in ("gpu", "auto") and gpus:
        return []
    if nproc == "gpu":
        return ["--nproc-per-node is 'gpu' on a node without GPUs: torchrun refuses it "
                "('Cuda is not available')"]
    if nproc in ("auto", "cpu"):
        return [f"--nproc-per-node is {nproc!r} on a node without GPUs: one worker per CPU "
                "core, expected 1"]
    want = gpus or 1
    if nproc != str(want):
        has = f"this node has {gpus} GPUs" if gpus else "this node has no GPU"
        return [f"--nproc-per-node is {nproc!r}, {has}: expected {want}"]
    return []


def job_problems(fn, job: tuple) -> tuple[list[str], list[dict]]:
    """fn's flags on every node of `job`: what is wrong on the first node where anything is,
    else what the nodes do not agree on; and what torchrun reads on each node."""
    _, _, hosts, gpus = job
    read = []
    for n, (env, names) in enumerate(job_nodes(*job)):
        try:
            answer = fn(dict(env), list(names))
        except Exception as e:  # noqa: BLE001 - a crash on one node names that node
            return [f"node {n}: raised {type(e).__name__}: {_first_line(e)}"], read
        if not isinstance(answer, (dict, list, tuple)):
            return [f"node {n}: got {answer!r}, expected a dict of flags"], read
        try:
            got = torchrun_reads(answer)
        except Refused as e:
            return [f"node {n}: torchrun refuses these flags: {_first_line(e)}"], read
        problems = node_problems(got, hosts, gpus)
        if problems:
            return [f"node {n}: {p}" for p in problems], read
        read.append(got)
    return disagreements(read), read


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


AGREED = (("endpoint", "--rdzv-endpoint"), ("id", "--rdzv-id"), ("nnodes", "--nnodes"))


def _shown(key: str, value) -> str:
    return f"{value[0]}:{value[1]}" if key == "endpoint" else repr(value)


def disagreements(read: list[dict]) -> list[str]:
    """The flags every node of a job must give alike and that these nodes do not."""
    wrong = []
    for key, flag in AGREED:
        values = [r[key] for r in read]
        if len(set(values)) > 1:
            n = next(i for i, v in enumerate(values) if v != values[0])
            wrong.append(f"{flag}: node 0 gives {_shown(key, values[0])}, node {n} "
                         f"{_shown(key, values[n])}: every node of a job must give the same")
    return wrong


def neighbour_problems(read: list[dict], other: list[dict], job: str) -> list[str]:
    """Two jobs on the same nodes (ids `job` and `job` + 1) must neither meet at one endpoint
    nor share a run id (torch's docs: an id that uniquely identifies the job)."""
    if not read or not other:
        return []
    (a, b), nxt = (read[0], other[0]), int(job) + 1
    wrong = []
    if a["endpoint"] == b["endpoint"]:
        wrong.append(f"jobs {job} and {nxt} on the same nodes both meet at "
                     f"{_shown('endpoint', a['endpoint'])}: the second job's agents would join "
                     "the first job's store")
    if a["id"] == b["id"]:
        default = " (torchrun's default)" if a["id"] == "none" else ""
        wrong.append(f"jobs {job} and {nxt} both use --rdzv-id {a['id']!r}{default}: each job "
                     "needs an id of its own")
    return wrong


def torchrun_flag_cases(fn: Callable[[dict, list[str]], dict[str, str]]) -> list[Case]:
    """One case per fake job: fn's flags on every node, read as torchrun reads them, judged by
    what they do (any port scheme, host of the job or run id that works passes), and against
    a second job on the same nodes."""
    cases = []
    for job in JOBS:
        job_id, nodelist, hosts, gpus = job
        name = (f"job {job_id} on {nodelist} ({len(hosts)} nodes, "
                f"{f'{gpus} GPUs each' if gpus else 'no GPUs'})")
        problems, read = job_problems(fn, job)
        if not problems:
            other_problems, other = job_problems(fn, (str(int(job_id) + 1), *job[1:]))
            problems = ([f"job {int(job_id) + 1}, {p}" for p in other_problems]
                        or neighbour_problems(read, other, job_id))
        cases.append(Case(name, not problems, "; ".join(problems)))
    return cases


# ---------------------------------------------------------------- exercises


@exercise_check("torchrun_flags_from_slurm", "file")
def check_torchrun_flags_from_slurm(module) -> list:
    """The learner's flags on every node of four fake jobs (two to four nodes, compressed node
    lists, a CPU-only job) and of a neighbouring job on the same nodes, read by torchrun's own
    parser and judged by what they do: one endpoint on one of the job's nodes, the job's node
    count, a worker per GPU, restarts allowed, and an endpoint and run id of the job's own."""
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
