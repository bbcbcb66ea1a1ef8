"""Nothing lost: checkpoints survive a rank killed mid-write; bad paths and files are refused."""

import subprocess
import sys

import pytest
import rank_fns
import torch

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons import mnist_two_gpus as mnist


def test_rank_killed_while_saving_leaves_the_last_complete_checkpoint(tmp_path, no_leftovers):
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(dh.RankDied, match="rank 0 of 2 was killed by signal SIGKILL"):
        dh.launch(rank_fns.save_twice_killed_mid_second_save, args=(2, str(path)), nprocs=2,
                  timeout=60)
    model = mnist.load_checkpoint(path, "linear")  # the first save: complete, loadable
    assert torch.equal(model.state_dict()["1.bias"], torch.full((10,), 1.0))
    # Beside it only the half-written next one, under its temporary name, which a SIGKILLed
    # process cannot remove (it must never have replaced checkpoint.pt).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.tmp", "checkpoint.pt"]
    assert (tmp_path / ".checkpoint.pt.tmp").stat().st_size == 100


def test_corrupt_checkpoint_names_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    with pytest.raises(mnist.CheckpointError, match=r"checkpoint .*checkpoint.pt cannot be "
                                                    r"loaded .*delete it and train again"):
        mnist.load_checkpoint(bad, "linear")


def test_truncated_checkpoint_is_refused(tmp_path):
    good = tmp_path / "good.pt"
    torch.save(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).state_dict(),
               good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(mnist.CheckpointError, match="cut.pt cannot be loaded"):
        mnist.load_checkpoint(cut, "linear")


def test_data_root_that_is_a_file_is_refused(tmp_path):
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("oops")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        data.prepare_data(not_a_dir)


def test_command_line_refuses_a_data_root_that_is_a_file_before_starting(tmp_path):
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("oops")
    done = subprocess.run([sys.executable, "-m", "ddp_helpers.mnist", "--data-root",
                           str(not_a_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "is a file, not a folder" in done.stderr
    assert "[rank" not in done.stdout  # nothing was launched
