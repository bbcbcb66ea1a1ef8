"""Lesson 08: one training function under dh.launch, under torchrun and as two c10d "nodes"; the
device from LOCAL_RANK; a killed rank that torchrun restarts and that resumes from the
checkpoint; the steps a restart redoes, measured for the exercise's table; torchrun output
without machine paths; the Slurm scripts run against a fake srun and scontrol. Real gloo ranks.

Where two processes fail together, a test asserts only what is guaranteed: which of them torchrun
or dh.launch names first is a race (rank 0 dies of the lost connection within the same moment
as the killed rank 1)."""

import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import beyond_one_machine as lesson

ROOT = Path(__file__).resolve().parents[1]
SLURM_SCRIPT = ROOT / "examples" / "slurm_torchrun.sh"
SBATCH = ROOT / "examples" / "slurm_ddp.sbatch"
SRUN_TASK = ROOT / "examples" / "slurm_srun_task.sh"
SRUN_SBATCH = ROOT / "examples" / "slurm_srun.sbatch"
MODULE = lesson.__name__  # the module torchrun runs: python -m ddp_helpers.lessons.beyond_one_...
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS, EVERY, FAULT = 12, 4, 7
TRAIN = f"-m {MODULE} --steps {STEPS} --ckpt-every {EVERY}"
HANG_GUARD = 240  # seconds: only stops a hung run, never a pass/fail criterion


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted two-rank run through dh.launch: what every other way must reproduce."""
    out = str(tmp_path_factory.mktemp("reference"))
    results = dh.launch(lesson.train, args=(2, out, STEPS, EVERY), nprocs=2, timeout=HANG_GUARD,
                        output="none")
    return {"out": out, "results": results,
            "losses": {r["rank"]: r["losses"] for r in results}, "params": results[0]["params"]}


def _module(**functions) -> types.ModuleType:
    module = types.ModuleType("attempt")
    module.__dict__.update(functions)
    return module


# ---------------------------------------------------------------- dh.launch and the files


def test_launch_run_writes_the_records_it_returns(reference):
    records = lesson.collect(reference["out"])
    assert [(r["attempt"], r["rank"], r["world_size"]) for r in records] == [(0, 0, 2), (0, 1, 2)]
    assert lesson.loss_by_rank(records) == reference["losses"]
    assert len(reference["losses"][0]) == STEPS
    assert reference["losses"][0] != reference["losses"][1]  # different shards, different batches
    assert reference["losses"][0][-1] < reference["losses"][0][0]  # it does learn
    assert torch.equal(lesson.final_params(reference["out"]), reference["params"])


def test_launch_records_rank_local_rank_and_device(reference):
    records = lesson.collect(reference["out"])
    assert [(r["rank"], r["local_rank"], r["group_rank"], r["device"]) for r in records] == [
        (0, 0, 0, "cpu"), (1, 1, 0, "cpu")]  # one "node": LOCAL_RANK is RANK


def test_ranks_train_on_disjoint_shards_of_each_batch():
    shards = [lesson.batch_indices(3, r, 2) for r in range(2)]
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert len(shards[0]) + len(shards[1]) == lesson.GLOBAL_BATCH
    assert torch.equal(lesson.batch_indices(3, 1, 2), shards[1])  # a function of the step alone


def test_relaunch_resumes_from_the_checkpoint_and_ends_where_an_uninterrupted_run_does(
        reference, tmp_path):
    out = str(tmp_path)
    # rank 1 is SIGKILLed; rank 0, losing its peer mid all-reduce, may be reported first
    with pytest.raises((dh.RankDied, dh.RankRaised)):
        dh.launch(lesson.train, args=(2, out, STEPS, EVERY, FAULT), nprocs=2, timeout=HANG_GUARD,
                  output="none")
    assert lesson.restart_summary(lesson.collect(out))["attempts"] == {
        0: {"resumed_from": 0, "last_step": FAULT - 1}}  # the run stopped at the fault
    # dh.launch does not restart: the learner relaunches, without the fault this time
    results = dh.launch(lesson.train, args=(2, out, STEPS, EVERY), nprocs=2, timeout=HANG_GUARD,
                        output="none")
    assert [r["resumed_from"] for r in results] == [4, 4]
    assert torch.equal(results[0]["params"], reference["params"])
    # a rerun (as after a Slurm requeue: torchrun's restart count is 0 again) is attempt 1 and
    # keeps attempt 0's records
    assert lesson.restart_summary(lesson.collect(out)) == {"attempts": {
        0: {"resumed_from": 0, "last_step": FAULT - 1},
        1: {"resumed_from": 4, "last_step": STEPS}}, "steps_redone": FAULT - 1 - 4}


def test_fault_step_outside_the_run_is_refused_with_the_range(tmp_path):
    with pytest.raises(dh.RankRaised, match=r"fault_step=99 is outside steps 1\.\.12"):
        dh.launch(lesson.train, args=(2, str(tmp_path), STEPS, EVERY, 99), nprocs=2, timeout=60,
                  output="none")


def test_checkpoint_write_that_fails_leaves_the_old_checkpoint_and_no_temp_file(tmp_path):
    path = tmp_path / lesson.CHECKPOINT
    lesson.save_checkpoint({"step": 4}, path)
    with pytest.raises(Exception, match="pickle|lambda"):
        lesson.save_checkpoint({"step": 8, "bad": lambda: 0}, path)
    assert lesson.load_checkpoint(tmp_path) == {"step": 4}
    assert [p.name for p in tmp_path.iterdir()] == [lesson.CHECKPOINT]


# A child that saves step 5, then starts saving step 10 and stops in the middle of it: pickling
# Blocker prints a line and sleeps, with the temporary file open and partly written.
_SAVER = """
import sys, time
from ddp_helpers.lessons import beyond_one_machine as lesson

class Blocker:
    def __reduce__(self):
        print("mid-save", flush=True)
        time.sleep(600)

lesson.save_checkpoint({"step": 5}, sys.argv[1])
lesson.save_checkpoint({"step": 10, "block": Blocker()}, sys.argv[1])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_kill_mid_save_keeps_the_old_checkpoint_and_the_next_save_removes_its_temp_file(
        sig, tmp_path):
    path = tmp_path / lesson.CHECKPOINT
    child = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "mid-save"
    finally:
        child.send_signal(sig)  # what torchrun's agent sends a worker when another one fails
        child.wait()
    assert child.returncode == -sig
    left = tmp_path / f".{lesson.CHECKPOINT}.{child.pid}.tmp"
    assert left.exists()  # the killed writer ran no clean-up
    assert lesson.load_checkpoint(tmp_path) == {"step": 5}  # the old checkpoint, whole
    lesson.save_checkpoint({"step": 15}, path)
    assert lesson.load_checkpoint(tmp_path) == {"step": 15}
    assert [p.name for p in tmp_path.iterdir()] == [lesson.CHECKPOINT]


def test_a_running_writers_temp_file_is_kept(tmp_path):
    path = tmp_path / lesson.CHECKPOINT
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        mine = tmp_path / f".{lesson.CHECKPOINT}.{alive.pid}.tmp"
        mine.write_bytes(b"being written")
        dead = tmp_path / f".{lesson.CHECKPOINT}.{_pid_of_an_exited_process()}.tmp"
        dead.write_bytes(b"left by a killed writer")
        assert lesson.remove_stale_temporaries(path) == [dead]
        assert mine.exists()
    finally:
        alive.kill()
        alive.wait()


def _pid_of_an_exited_process() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: no process has this pid until the system hands it out again
    return done.pid


# ---------------------------------------------------------------- the steps a restart redoes


@pytest.mark.parametrize("fault_step, every", sorted(lesson.REDONE))
def test_steps_redone_table_is_what_a_killed_and_relaunched_run_redoes(fault_step, every,
                                                                      tmp_path):
    steps = fault_step + 1
    with pytest.raises((dh.RankDied, dh.RankRaised)):  # rank 1 killed; rank 0 may be named first
        dh.launch(lesson.train, args=(2, str(tmp_path), steps, every, fault_step), nprocs=2,
                  output="none", timeout=120)
    # What torchrun's restart does, by hand: relaunch as attempt 1, without the fault.
    dh.launch(lesson.train, args=(2, str(tmp_path), steps, every), nprocs=2, output="none",
              timeout=120, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    summary = lesson.restart_summary(lesson.collect(tmp_path))
    assert summary["attempts"][0]["last_step"] == fault_step - 1
    assert summary["steps_redone"] == lesson.REDONE[fault_step, every]


def test_steps_redone_check_passes_the_solution_and_fails_a_constant():
    from ddp_helpers.solutions.steps_redone import steps_redone

    check = exercises.find("steps_redone").check
    assert all(c.ok for c in check(_module(steps_redone=steps_redone)))
    for constant in range(5):  # `return 2`, the lesson's own answer, among them
        assert not all(c.ok for c in check(_module(steps_redone=lambda f, k, c=constant: c)))
    with pytest.raises(exercises.NotAttempted):
        check(_module())


# ---------------------------------------------------------------- torchrun


def test_module_without_torchrun_says_how_to_start_it(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", MODULE, "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=HANG_GUARD)
    assert p.returncode == 2
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in p.stderr
    assert f"torchrun --nproc-per-node 2 -m {MODULE}" in p.stderr


def _no_machine_paths(output: str) -> None:
    for path in (str(ROOT), sys.prefix, "/tmp/", "site-packages", "dist-packages"):
        assert path not in output, f"{path} in torchrun's output:\n{output[-3000:]}"


@pytest.mark.slow
def test_two_torchrun_nodes_meet_through_c10d_and_train_like_launch(reference, tmp_path):
    agent = (f"torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "
             f"127.0.0.1:{dh.free_port()} --rdzv-id test08 {TRAIN} --out {tmp_path}")
    runs = lesson.torchrun_agents([agent, agent], timeout=HANG_GUARD)
    assert [r["returncode"] for r in runs] == [0, 0], runs
    for run in runs:
        _no_machine_paths(run["output"])
    records = lesson.collect(tmp_path)
    # RANK counts across nodes; LOCAL_RANK starts again at 0 on each; GROUP_RANK is the node's
    assert sorted((r["rank"], r["local_rank"], r["group_rank"], r["world_size"])
                  for r in records) == [(0, 0, 0, 2), (1, 0, 1, 2)]
    assert lesson.loss_by_rank(records) == reference["losses"]
    assert torch.equal(lesson.final_params(tmp_path), reference["params"])


@pytest.mark.slow
def test_killed_rank_is_restarted_by_torchrun_and_resumes_to_the_same_parameters(
        reference, tmp_path):
    cmd = (f"torchrun --standalone --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1 "
           f"{TRAIN} --fault-step {FAULT} --out {tmp_path}")
    # A fresh store per attempt (pytorch/pytorch#135712; see the lesson)
    (run,) = lesson.torchrun_agents([cmd], envs=[{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}],
                                    timeout=HANG_GUARD)
    assert run["returncode"] == 0, run["output"][-3000:]
    _no_machine_paths(run["output"])  # lesson 08 prints this log (torchrun's own lines too)
    assert f"rank 1: killed with SIGKILL at step {FAULT} (attempt 0)" in run["output"]
    assert "resumed from the checkpoint of step 4" in run["output"]
    assert "2 step(s) are redone (checkpoint interval 4)" in run["output"]
    records = lesson.collect(tmp_path)
    summary = lesson.restart_summary(records)
    assert summary["attempts"] == {0: {"resumed_from": 0, "last_step": FAULT - 1},
                                   1: {"resumed_from": 4, "last_step": STEPS}}
    assert summary["steps_redone"] == 2
    torch.testing.assert_close(lesson.final_params(tmp_path), reference["params"], rtol=1e-6,
                               atol=1e-7)
    assert lesson.loss_by_rank(records) == reference["losses"]  # the curve continues, unchanged


@pytest.mark.slow
def test_without_restarts_the_killed_rank_fails_the_run(tmp_path):
    cmd = (f"torchrun --standalone --nproc-per-node 2 --max-restarts 0 {TRAIN} --fault-step 3 "
           f"--out {tmp_path}")
    (run,) = lesson.torchrun_agents([cmd], timeout=HANG_GUARD)
    assert run["returncode"] != 0
    # torchrun lists every worker that had failed when it looked; rank 1 died first, so it is
    # always among them. Which one it calls the root cause is a race (rank 0 dies of the lost
    # connection, by SIGABRT or an error, within the same second): not checked.
    failures = torchrun_failures(run["output"])
    assert 1 in failures, run["output"][-3000:]
    assert failures[1]["exitcode"] == "-9"
    assert failures[1]["traceback"].startswith("Signal 9 (SIGKILL) received by PID")
    assert lesson.restart_summary(lesson.collect(tmp_path))["attempts"] == {
        0: {"resumed_from": 0, "last_step": 2}}  # the records stop at the fault step


def torchrun_failures(output: str) -> dict[int, dict[str, str]]:
    """torchrun's failure report as {global rank: {"exitcode": ..., "traceback": ...}}."""
    entries = re.finditer(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+).*\n"
                          r"(?:.*\n)*?\s*traceback\s*: (.*)$", output, flags=re.M)
    return {int(m.group(1)): {"exitcode": m.group(2), "traceback": m.group(3)} for m in entries}


def test_torchrun_failures_reads_every_entry_of_the_report():
    report = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_01:02:03
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 11)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 11
Failures:
[1]:
  time      : 2026-12-01_01:02:03
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
"""
    assert torchrun_failures(report) == {
        0: {"exitcode": "-6", "traceback": "Signal 6 (SIGABRT) received by PID 11"},
        1: {"exitcode": "-9", "traceback": "Signal 9 (SIGKILL) received by PID 12"}}


def test_readable_output_has_no_machine_paths_c_sources_or_carets(tmp_path):
    venv = f"{sys.prefix}/lib/python3.11/site-packages"
    text = (f'  File "{venv}/torch/run.py", line 3, in main\n'
            "    return f(*args)\n"
            "           ^^^^^^^^\n"
            "[rank0]:     ^^^^^^^^\n"
            "  RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:545] Connection reset\n"
            f"  error_file: {tmp_path}/attempt_0/1/error.json of binary: {sys.executable}\n"
            # torchrun's own log lines name their source file, relative to the working folder
            "W1201 05:11:56.316000 17255 .venv/lib/python3.11/site-packages/torch/distributed/"
            "elastic/multiprocessing/api.py:1028] Sending process 17262 closing signal SIGTERM\n"
            "E1201 05:11:56.431000 17255 /usr/lib/python3/dist-packages/torch/distributed/"
            "elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1\n")
    assert lesson.readable(text, log_dir=tmp_path) == (
        '  File "torch/run.py", line 3, in main\n'
        "    return f(*args)\n"
        "  RuntimeError: Connection reset\n"
        "  error_file: <logs>/attempt_0/1/error.json of binary: python\n"
        "W1201 05:11:56.316000 17255 torch/distributed/elastic/multiprocessing/api.py:1028] "
        "Sending process 17262 closing signal SIGTERM\n"
        "E1201 05:11:56.431000 17255 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: -9) local_rank: 1\n")


# ---------------------------------------------------------------- the Slurm scripts


def fake_slurm(tmp_path: Path, hostnames: list[str], job_id: int, nodes: int) -> dict:
    """A fake `scontrol` on PATH and the variables srun sets, as on a real allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    lines = "\n".join(hostnames)
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] || '
                        '{ echo "unexpected: $*" >&2; exit 1; }\n'
                        f"printf '%s\\n' '{lines}'\n")
    scontrol.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": str(nodes)}


def test_slurm_script_builds_the_torchrun_command_from_slurm_variables(tmp_path):
    env = {**fake_slurm(tmp_path, ["gpu07", "gpu08"], 123456, 2), "SLURM_NODEID": "1",
           "SLURM_GPUS_ON_NODE": "4", "DRY_RUN": "1"}
    base = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    p = subprocess.run(["bash", str(SLURM_SCRIPT), "-m", MODULE],
                       capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert p.returncode == 0, p.stderr
    args = p.stdout.split("\n")
    assert args[:15] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "4",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29956",
                         "--rdzv-id", "slurm-123456", "--max-restarts", "1", "-m", MODULE]
    assert "node 1 of 2: rendezvous at gpu07:29956, 4 worker(s) here" in p.stderr


def test_slurm_script_outside_a_job_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", str(SLURM_SCRIPT)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode != 0
    assert "not inside a Slurm job: run this through srun" in p.stderr


@pytest.mark.slow
def test_slurm_script_runs_two_nodes_on_this_machine(reference, tmp_path):
    env = {**fake_slurm(tmp_path, ["127.0.0.1", "127.0.0.1"], 77, 2), "NPROC_PER_NODE": "1",
           "MASTER_PORT": str(dh.free_port()), "TORCHRUN": " ".join(TORCHRUN),
           # (no /tmp/torchelastic_* folder left behind per agent)
           "TMPDIR": str(tmp_path)}
    out = tmp_path / "run"
    node = f"bash {SLURM_SCRIPT} {TRAIN} --out {out}"
    procs = [subprocess.Popen(node.split(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT, start_new_session=True,
                              env={**os.environ, **env, "SLURM_NODEID": str(n)})
             for n in (0, 1)]
    try:
        outputs = [p.communicate(timeout=HANG_GUARD)[0] for p in procs]
    finally:
        for p in procs:  # a hung node: stop it and its workers
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for n, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {n}:\n{output[-3000:]}"
    records = lesson.collect(out)
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert lesson.loss_by_rank(records) == reference["losses"]


def test_sbatch_script_gives_srun_the_cpus_and_the_lesson_module(tmp_path):
    (tmp_path / "srun").write_text('#!/bin/sh\necho "SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK"\n'
                                   'echo "$@"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))},
           "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "99",
           "SLURM_CPUS_PER_TASK": "8"}
    p = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "SRUN_CPUS_PER_TASK=8"  # Slurm 22.05+: srun does not inherit it
    assert f"-m {MODULE} --out runs/slurm-99" in lines[1]
    header = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in header and "#SBATCH --output=runs/slurm-%j.out" in header


def test_srun_task_script_turns_slurm_variables_into_torchs():
    env, hosts = lesson.srun_env("4242", "gpu[07-08]", ["gpu07", "gpu08"], node=1, gpus=2,
                                 tasks_per_node=2, local=1)
    assert lesson.srun_task_env(env, hosts) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": "29742"}  # the first host; the job's port
    assert lesson.srun_task_env({**env, "MASTER_PORT": "12345"}, hosts)["MASTER_PORT"] == "12345"


def test_srun_task_script_outside_a_task_or_without_tasks_per_node_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", str(SRUN_TASK)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode != 0 and "not a Slurm task: run this through srun" in p.stderr
    env, hosts = lesson.srun_env("4242", "gpu[07-08]", ["gpu07", "gpu08"], node=0)
    del env["SLURM_NTASKS_PER_NODE"]
    with pytest.raises(RuntimeError, match="give srun --ntasks-per-node"):
        lesson.srun_task_env(env, hosts)


def test_srun_sbatch_starts_the_task_script_per_gpu(tmp_path):
    (tmp_path / "srun").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))},
           "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "99"}
    p = subprocess.run(["bash", str(SRUN_SBATCH)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["--kill-on-bad-exit=1", "examples/slurm_srun_task.sh"]
    assert f"-m {MODULE} --out runs/slurm-99" in p.stdout
    header = [ln for ln in SRUN_SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert {"#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
            "#SBATCH --requeue"} <= set(header)


@pytest.mark.slow
def test_srun_tasks_without_torchrun_train_like_launch(reference, tmp_path):
    tasks = lesson.srun_tasks(TRAIN.split() + ["--out", str(tmp_path)], timeout=HANG_GUARD)
    assert [t["returncode"] for t in tasks] == [0, 0], tasks
    assert lesson.loss_by_rank(lesson.collect(tmp_path)) == reference["losses"]


def test_an_interface_gloo_cannot_find_is_named_at_init():
    assert lesson.init_with_interface("eth9") == (
        "GLOO_SOCKET_IFNAME=eth9: RuntimeError: Unable to find address for: eth9")
    assert lesson.init_with_interface("lo") == "GLOO_SOCKET_IFNAME=lo: the group started"


def test_torchrun_flags_check_passes_the_scripts_own_flags_and_another_scheme():
    """The check reads flags by meaning: the script's own command passes on every fake job, so
    does a rendezvous on the last node with another port scheme; no flags fail every job."""
    from ddp_helpers.solutions.torchrun_flags_from_slurm import torchrun_flags_from_slurm

    check = exercises.find("torchrun_flags_from_slurm").check

    def the_script(env, hosts):
        command = lesson.slurm_torchrun_command(env, hosts)
        assert command[0] == "torchrun"
        return command[1:]

    def last_host(env, hosts):  # the store on the last node, a port of another range
        right = torchrun_flags_from_slurm(env, hosts)
        port = 40000 + int(env["SLURM_JOB_ID"]) % 20000
        return {**right, "--rdzv-endpoint": f"{hosts[-1]}:{port}"}

    for answer in (the_script, last_host):
        cases = check(_module(torchrun_flags_from_slurm=answer))
        assert [c.ok for c in cases] == [True] * len(lesson.JOBS), cases
    none = check(_module(torchrun_flags_from_slurm=lambda env, hosts: None))
    assert [c.detail for c in none] == ["node 0: got None, expected a dict of flags"] * 4
