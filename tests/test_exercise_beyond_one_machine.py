"""Lesson 08's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. torchrun_flags_from_slurm is checked on five srun environments (up to four
nodes, compressed node lists, a node other than the first) with the flags read by torchrun's
own parser, so any spelling torchrun accepts passes; steps_redone against measured restarts."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

from ddp_helpers import exercises

JOB_4242_0 = "job 4242 on gpu[07-08], node 0 of 2: "
JOB_4242_1 = "job 4242 on gpu[07-08], node 1 of 2: "
JOB_918273 = "job 918273 on a100-[3,5,9-10], node 2 of 4: "
JOB_77 = "job 77 on cpu01, node 0 of 1: "
NPROC = 'env.get("SLURM_GPUS_ON_NODE", "1")'
ENDPOINT = 'f"{hostnames[0]}:{port}"'
RDZV = ('        "--rdzv-backend": "c10d",\n        "--rdzv-endpoint": f"{hostnames[0]}:{port}",\n'
        '        "--rdzv-id": f"slurm-{job}",  # the same on every node of the job, unique per '
        'job\n')

FLAGS_WRONG = {  # label: (answer, text its FAIL must name)
    "nproc from SLURM_NTASKS (tasks in the job)": (
        edit("torchrun_flags_from_slurm", NPROC, 'env["SLURM_NTASKS"]'),
        JOB_918273 + "--nproc-per-node is '4', the script gives '8'"),
    "nproc from SLURM_NTASKS_PER_NODE": (
        edit("torchrun_flags_from_slurm", NPROC, 'env["SLURM_NTASKS_PER_NODE"]'),
        JOB_4242_0 + "--nproc-per-node is '1', the script gives '2'"),
    "GPUs on the node, no default for a CPU node": (
        edit("torchrun_flags_from_slurm", NPROC, 'env["SLURM_GPUS_ON_NODE"]'),
        JOB_77 + "raised KeyError: 'SLURM_GPUS_ON_NODE'"),
    "the endpoint on this node": (
        edit("torchrun_flags_from_slurm", ENDPOINT, 'f"{env[\'SLURMD_NODENAME\']}:{port}"'),
        JOB_4242_1 + "--rdzv-endpoint is 'gpu08:29742', the script gives 'gpu07:29742'"),
    "the endpoint on the last node": (
        edit("torchrun_flags_from_slurm", ENDPOINT, 'f"{hostnames[-1]}:{port}"'),
        JOB_4242_0 + "--rdzv-endpoint is 'gpu08:29742'"),
    "the compressed node list as the host": (
        edit("torchrun_flags_from_slurm", ENDPOINT, 'f"{env[\'SLURM_JOB_NODELIST\']}:{port}"'),
        JOB_4242_0 + "--rdzv-endpoint is 'gpu[07-08]:29742'"),
    "the port from the whole job id": (
        edit("torchrun_flags_from_slurm", "29500 + int(job) % 1000", "29500 + int(job)"),
        JOB_4242_0 + "--rdzv-endpoint is 'gpu07:33742', the script gives 'gpu07:29742'"),
    "MASTER_PORT ignored": (
        edit("torchrun_flags_from_slurm", 'env.get("MASTER_PORT", str(29500 + int(job) % 1000))',
             "str(29500 + int(job) % 1000)"),
        JOB_77 + "--rdzv-endpoint is 'cpu01:29577', the script gives 'cpu01:12345'"),
    "no rdzv id": (
        edit("torchrun_flags_from_slurm", '        "--rdzv-id": f"slurm-{job}",', "#"),
        JOB_4242_0 + "--rdzv-id is missing (torchrun's default: 'none'), the script gives "
        "'slurm-4242'"),
    "no max restarts": (
        edit("torchrun_flags_from_slurm", '        "--max-restarts": "1",\n', ""),
        JOB_4242_0 + "--max-restarts is missing (torchrun's default: 0), the script gives 1"),
    "static rendezvous, node rank from SLURM_PROCID": (
        edit("torchrun_flags_from_slurm", RDZV,
             '        "--node-rank": env["SLURM_PROCID"],\n'
             '        "--master-addr": hostnames[0],\n        "--master-port": port,\n'),
        JOB_4242_0 + "--rdzv-backend is missing (torchrun's default: 'static'), the script "
        "gives 'c10d'"),
    "--standalone added": (
        edit("torchrun_flags_from_slurm", '"--rdzv-backend": "c10d",',
             '"--rdzv-backend": "c10d",\n        "--standalone": True,'),
        JOB_4242_0 + "--standalone is True, the script leaves torchrun's default False"),
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
