"""Lesson 08's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. torchrun_flags_from_slurm is called on every node of four fake jobs (two to
four nodes, compressed node lists, CPU nodes) and of a neighbouring job, its flags read by
torchrun's own parser and judged by what they do, so any spelling torchrun accepts, and any
port scheme, host of the job or run id that works, passes; steps_redone against measured
restarts."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

from ddp_helpers import exercises

JOB_4242 = "job 4242 on gpu[07-08] (2 nodes, 2 GPUs each): "
JOB_918273 = "job 918273 on a100-[3,5,9-10] (4 nodes, 8 GPUs each): "
JOB_77 = "job 77 on cpu[01-02] (2 nodes, no GPUs): "
NPROC = 'env.get("SLURM_GPUS_ON_NODE", "1")'
ENDPOINT = 'f"{hostnames[0]}:{port}"'
PORT = 'env.get("MASTER_PORT", str(29500 + int(job) % 1000))'
RDZV_ID = 'f"slurm-{job}"'
RDZV = ('        "--rdzv-backend": "c10d",\n        "--rdzv-endpoint": f"{hostnames[0]}:{port}",\n'
        '        "--rdzv-id": f"slurm-{job}",  # the same on every node of the job, unique per '
        'job\n')


def _flags(old: str, new: str) -> str:
    return edit("torchrun_flags_from_slurm", old, new)


FLAGS_WRONG = {  # label: (answer, text its FAIL must name)
    # another topology with the same values where it matters: tasks, not GPUs
    "nproc from SLURM_NTASKS (tasks in the job)": (
        _flags(NPROC, 'env["SLURM_NTASKS"]'),
        JOB_918273 + "node 0: --nproc-per-node is '4', this node has 8 GPUs: expected 8"),
    "nproc from SLURM_NTASKS_PER_NODE": (
        _flags(NPROC, 'env["SLURM_NTASKS_PER_NODE"]'),
        JOB_4242 + "node 0: --nproc-per-node is '1', this node has 2 GPUs: expected 2"),
    "GPUs on the node, no default for a CPU node": (
        _flags(NPROC, 'env["SLURM_GPUS_ON_NODE"]'),
        JOB_77 + "node 0: raised KeyError: 'SLURM_GPUS_ON_NODE'"),
    "'auto' workers, also on CPU nodes": (
        _flags(NPROC, '"auto"'),
        JOB_77 + "node 0: --nproc-per-node is 'auto' on a node without GPUs: one worker per "
        "CPU core, expected 1"),
    # this node's value read where the job's is meant
    "the endpoint on this node": (
        _flags(ENDPOINT, 'f"{env[\'SLURMD_NODENAME\']}:{port}"'),
        JOB_4242 + "--rdzv-endpoint: node 0 gives gpu07:29742, node 1 gpu08:29742: every node "
        "of a job must give the same"),
    "a run id per node": (
        _flags(RDZV_ID, 'f"slurm-{job}-{env[\'SLURM_NODEID\']}"'),
        JOB_4242 + "--rdzv-id: node 0 gives 'slurm-4242-0', node 1 'slurm-4242-1'"),
    "nodes counted as tasks per node": (
        _flags('env["SLURM_JOB_NUM_NODES"]', 'env["SLURM_NTASKS_PER_NODE"]'),
        JOB_4242 + "node 0: --nnodes is '1', the job has 2 nodes"),
    # the world written in: right on the two-node jobs, wrong on the others
    "two nodes written in": (
        _flags('env["SLURM_JOB_NUM_NODES"]', '"2"'),
        JOB_918273 + "node 0: --nnodes is '2', the job has 4 nodes"),
    "elastic 1:N nodes": (
        _flags('env["SLURM_JOB_NUM_NODES"]', '"1:" + env["SLURM_JOB_NUM_NODES"]'),
        JOB_4242 + "node 0: --nnodes is '1:2', the job has 2 nodes (MIN:MAX lets the "
        "rendezvous start with fewer)"),
    "the compressed node list as the host": (
        _flags(ENDPOINT, 'f"{env[\'SLURM_JOB_NODELIST\']}:{port}"'),
        JOB_4242 + "node 0: torchrun refuses these flags: The hostname of the rendezvous endpoint "
        "'gpu[07-08]:29742' must be"),
    "the login node (where sbatch ran) as the host": (
        _flags(ENDPOINT, 'f"{env[\'SLURM_SUBMIT_HOST\']}:{port}"'),
        JOB_4242 + "node 0: --rdzv-endpoint host 'login01' is not one of the job's nodes "
        "(gpu07, gpu08)"),
    "localhost as the endpoint": (
        _flags(ENDPOINT, 'f"localhost:{port}"'),
        JOB_4242 + "node 0: --rdzv-endpoint host 'localhost' is every node's own machine"),
    "the port from the whole job id": (
        _flags("29500 + int(job) % 1000", "29500 + int(job)"),
        JOB_918273 + "node 0: torchrun refuses these flags: The port number of the rendezvous "
        "endpoint 'a100-3:947773' must be an integer"),
    "a port below 1024": (
        _flags("29500 + int(job) % 1000", "int(job) % 1000"),
        JOB_4242 + "node 0: --rdzv-endpoint port 242 needs root"),
    "one fixed port for every job": (
        _flags(PORT, '"29500"'),
        JOB_4242 + "jobs 4242 and 4243 on the same nodes both meet at gpu07:29500: the second "
        "job's agents would join the first job's store"),
    "no rdzv id": (
        _flags('        "--rdzv-id": f"slurm-{job}",', "#"),
        JOB_4242 + "jobs 4242 and 4243 both use --rdzv-id 'none' (torchrun's default)"),
    "one fixed rdzv id": (
        _flags(RDZV_ID, '"lesson08"'),
        JOB_4242 + "jobs 4242 and 4243 both use --rdzv-id 'lesson08'"),
    "no max restarts": (
        _flags('        "--max-restarts": "1",\n', ""),
        JOB_4242 + "node 0: --max-restarts is 0 (torchrun's default is 0)"),
    "static rendezvous, node rank from SLURM_PROCID": (
        _flags(RDZV, '        "--node-rank": env["SLURM_PROCID"],\n'
                     '        "--master-addr": hostnames[0],\n        "--master-port": port,\n'),
        JOB_4242 + "node 0: --rdzv-backend is 'static' (torchrun's default when none is given): "
        "the exercise asks for the c10d rendezvous"),
    "--standalone added": (
        _flags('"--rdzv-backend": "c10d",',
               '"--rdzv-backend": "c10d",\n        "--standalone": True,'),
        JOB_4242 + "node 0: --standalone: each node's torchrun makes a rendezvous of its own"),
    "a flag torchrun does not have": (
        _flags('"--max-restarts": "1",', '"--max-restarts": "1", "--gpus": "2",'),
        JOB_4242 + "node 0: torchrun refuses these flags: unrecognized arguments: --gpus"),
}

FLAGS_RIGHT = {
    "ints, underscore spellings, nodes counted from the host list": (
        "def torchrun_flags_from_slurm(env, hostnames):\n"
        "    job = int(env['SLURM_JOB_ID'])\n"
        "    port = int(env.get('MASTER_PORT', 29500 + job % 1000))\n"
        "    return {'--nnodes': len(hostnames),\n"
        "            '--nproc_per_node': int(env.get('SLURM_GPUS_ON_NODE', 1)),\n"
        "            '--rdzv_backend': 'c10d', '--rdzv_endpoint': f'{hostnames[0]}:{port}',\n"
        "            '--rdzv_id': f'slurm-{job}', '--max_restarts': 1}\n"),
    "a command line: --flag=value, --nnodes N:N, SLURM_NNODES, an ignored --node-rank": (
        "def torchrun_flags_from_slurm(env, hostnames):\n"
        "    n, job = env['SLURM_NNODES'], env['SLURM_JOB_ID']\n"
        "    port = env['MASTER_PORT'] if 'MASTER_PORT' in env else 29500 + int(job) % 1000\n"
        "    return [f'--nnodes={n}:{n}',\n"
        "            f\"--nproc-per-node={env.get('SLURM_GPUS_ON_NODE', 1)}\",\n"
        "            '--rdzv-backend=c10d', f'--rdzv-endpoint={hostnames[0]}:{port}',\n"
        "            f'--rdzv-id=slurm-{job}', '--max-restarts=1',\n"
        "            f\"--node-rank={env['SLURM_NODEID']}\"]\n"),
    "keys without dashes, flags in another order": (
        "def torchrun_flags_from_slurm(env, hostnames):\n"
        "    job = env['SLURM_JOBID']\n"
        "    port = env.get('MASTER_PORT') or str(29500 + int(job) % 1000)\n"
        "    flags = {'max-restarts': '1', 'rdzv-id': 'slurm-' + job}\n"
        "    flags['rdzv-endpoint'] = hostnames[0] + ':' + port\n"
        "    flags['rdzv-backend'] = 'c10d'\n"
        "    flags['nproc-per-node'] = env.get('SLURM_GPUS_ON_NODE', '1')\n"
        "    flags['nnodes'] = env['SLURM_JOB_NUM_NODES']\n"
        "    return flags\n"),
    # another port scheme, another host of the job, another run id: as correct as the script's
    "the last node hosts the store, a port and id of another scheme, 'gpu' workers": (
        "def torchrun_flags_from_slurm(env, hostnames):\n"
        "    job = int(env['SLURM_JOB_ID'])\n"
        "    gpus = 'gpu' if 'SLURM_GPUS_ON_NODE' in env else 1\n"
        "    return {'--nnodes': len(hostnames), '--nproc-per-node': gpus,\n"
        "            '--rdzv-backend': 'c10d',\n"
        "            '--rdzv-endpoint': f'{hostnames[-1]}:{20000 + job % 40000}',\n"
        "            '--rdzv-id': f'job{job}', '--max-restarts': 3}\n"),
    "ports from 1024 up, the bare job id as the run id, a master address c10d ignores": (
        "def torchrun_flags_from_slurm(env, hostnames):\n"
        "    job = env['SLURM_JOB_ID']\n"
        "    port = 1024 + int(job) % 64000\n"
        "    return ['--nnodes', env['SLURM_JOB_NUM_NODES'],\n"
        "            '--nproc-per-node', env.get('SLURM_GPUS_ON_NODE', '1'),\n"
        "            '--rdzv-backend', 'c10d', '--rdzv-endpoint', f'{hostnames[0]}:{port}',\n"
        "            '--rdzv-id', job, '--max-restarts', '1',\n"
        "            '--master-addr', 'ignored-under-c10d']\n"),
}


def test_wrong_torchrun_flags_fail_naming_the_case(tmp_path):
    lines = verdicts("torchrun_flags_from_slurm",
                     {k: src for k, (src, _) in FLAGS_WRONG.items()}, tmp_path)
    assert_all_fail("torchrun_flags_from_slurm", lines,
                    {k: named for k, (_, named) in FLAGS_WRONG.items()})


def test_torchrun_flags_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("torchrun_flags_from_slurm"),
               **FLAGS_RIGHT}
    assert_all_pass("torchrun_flags_from_slurm",
                    verdicts("torchrun_flags_from_slurm", answers, tmp_path))


FORMULA = "return finished - last_checkpoint"
REDONE_WRONG = {
    "the killed step counted": (edit("steps_redone", "finished = fault_step - 1",
                                     "finished = fault_step"),
                                "killed at step 13, checkpoint every 5: got 3, "
                                "expected 2"),
    "always the worst case": (edit("steps_redone", FORMULA, "return ckpt_every - 1"),
                              "killed at step 13, checkpoint every 5: got 4"),
    "the quotient, not the remainder": (
        edit("steps_redone", FORMULA, "return finished // ckpt_every"),
        "killed at step 7, checkpoint every 4: got 1, expected 2"),
    "fault_step % ckpt_every - 1": (
        edit("steps_redone", FORMULA, "return fault_step % ckpt_every - 1"),
        "killed at step 10, checkpoint every 5: got -1, expected 4"),
    "the checkpoint at the fault step's multiple": (
        edit("steps_redone", "last_checkpoint = finished // ckpt_every * ckpt_every",
             "last_checkpoint = fault_step // ckpt_every * ckpt_every"),
        "killed at step 10, checkpoint every 5: got -1, expected 4"),
    "nothing redone before the first checkpoint": (
        edit("steps_redone", FORMULA,
             "return finished - last_checkpoint if last_checkpoint else 0"),
        "killed at step 3, checkpoint every 10: got 0, expected 2"),
    "the interval subtracted": (edit("steps_redone", FORMULA,
                                     "return fault_step - ckpt_every"),
                                "killed at step 13, checkpoint every 5: got 8"),
}

REDONE_RIGHT = {
    "the remainder, one line": ("def steps_redone(fault_step, ckpt_every):\n"
                                "    return (fault_step - 1) % ckpt_every\n"),
    "a loop over the checkpoints, a float": (
        "def steps_redone(fault_step, ckpt_every):\n    last = 0\n"
        "    for step in range(1, fault_step):\n        if step % ckpt_every == 0:\n"
        "            last = step\n    return float(fault_step - 1 - last)\n"),
}


def test_wrong_steps_redone_fail_naming_the_case(tmp_path):
    lines = verdicts("steps_redone", {k: src for k, (src, _) in REDONE_WRONG.items()}, tmp_path)
    assert_all_fail("steps_redone", lines, {k: named for k, (_, named) in REDONE_WRONG.items()})


def test_steps_redone_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("steps_redone"), **REDONE_RIGHT}
    assert_all_pass("steps_redone", verdicts("steps_redone", answers, tmp_path))
