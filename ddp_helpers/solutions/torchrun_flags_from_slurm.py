"""Solution (lesson 08): the torchrun flags one node of a Slurm job needs, from its variables."""


def torchrun_flags_from_slurm(env: dict[str, str], hostnames: list[str]) -> dict[str, str]:
    """Map srun's variables and `scontrol show hostnames` output to torchrun's flags."""
    job = env["SLURM_JOB_ID"]
    # The first node hosts the rendezvous store; the port comes from the job id, so two jobs
    # whose first node is the same machine do not fight over one port.
    port = env.get("MASTER_PORT", str(29500 + int(job) % 1000))
    return {
        "--nnodes": env["SLURM_JOB_NUM_NODES"],
        "--nproc-per-node": env.get("SLURM_GPUS_ON_NODE", "1"),  # one worker per GPU
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": f"{hostnames[0]}:{port}",
        "--rdzv-id": f"slurm-{job}",  # the same on every node of the job, unique per job
        "--max-restarts": "1",
    }
