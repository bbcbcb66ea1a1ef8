"""Lesson 05's strip_ddp_prefix: plausible wrong answers FAIL naming the case (only a leading
"module." goes: one in the middle of a key stays, and so does "modules."), correct ones written
differently PASS, and no file is NOT ATTEMPTED."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, judge, verdicts

from ddp_helpers import exercises

STRIP = "k[len(PREFIX):] if k.startswith(PREFIX) else k"


def _body(expression: str) -> str:
    return edit("strip_ddp_prefix", STRIP, expression)


WRONG = {  # label: (answer, text its FAIL must name)
    "replace everywhere": (_body('k.replace(PREFIX, "")'), "case 3: keys"),
    "replace the first occurrence": (_body('k.replace(PREFIX, "", 1)'), "case 4: keys"),
    "lstrip, which strips characters": (_body("k.lstrip(PREFIX)"), "case 3: keys"),
    "always drop the first component": (_body('k.split(".", 1)[1]'), "case 2: keys"),
    "always cut 7 characters": (_body("k[len(PREFIX):]"), "case 2: keys"),
    "startswith without the dot": (
        _body('k[len(PREFIX):] if k.startswith("module") else k'), "case 5: keys"),
    "keep what follows the last module.": (_body("k.split(PREFIX)[-1]"), "case 3: keys"),
    "drop every component named module": (
        _body('".".join(p for p in k.split(".") if p != "module")'), "case 3: keys"),
    "strip every leading module. (a doubled prefix taken for DDP's)": (
        "import re\n\n\ndef strip_ddp_prefix(state_dict):\n"
        "    return {re.sub(r'^(module\\.)+', '', k): v for k, v in state_dict.items()}\n",
        "case 6: keys: got ['1.bias', 'scale'], expected ['1.bias', 'module.scale']"),
    "every tensor cast to float": (
        edit("strip_ddp_prefix", "else k: v for", "else k: v.float() for"),
        "case 7: bn.num_batches_tracked: got torch.float32, expected a tensor of torch.int64"),
    "values as lists": (
        edit("strip_ddp_prefix", "else k: v for", "else k: v.tolist() for"),
        "case 1: 1.weight: got list, expected a tensor of torch.float32"),
    "buffers dropped, parameters kept": (
        edit("strip_ddp_prefix", "state_dict.items()}",
             "state_dict.items() if v.is_floating_point()}"),
        "case 7: keys"),
}

RIGHT = {
    "str.removeprefix": _body("k.removeprefix(PREFIX)"),
    "torch's helper, in place": (
        "from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present\n\n\n"
        "def strip_ddp_prefix(state_dict):\n"
        "    consume_prefix_in_state_dict_if_present(state_dict, 'module.')\n"
        "    return state_dict\n"),
    "a loop over items into an OrderedDict": (
        "import re\nfrom collections import OrderedDict\n\n\ndef strip_ddp_prefix(state_dict):\n"
        "    out = OrderedDict()\n    for key, value in state_dict.items():\n"
        "        out[re.sub(r'^module\\.', '', key)] = value\n    return out\n"),
    "partition, and clones": (
        "def strip_ddp_prefix(state_dict):\n    out = {}\n"
        "    for key, value in state_dict.items():\n"
        "        head, dot, rest = key.partition('.')\n"
        "        out[rest if head == 'module' and dot else key] = value.clone()\n"
        "    return out\n"),
}


def test_wrong_strips_fail_naming_the_case(tmp_path):
    lines = verdicts("strip_ddp_prefix", {k: src for k, (src, _) in WRONG.items()}, tmp_path)
    assert_all_fail("strip_ddp_prefix", lines, {k: named for k, (_, named) in WRONG.items()})


def test_strips_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("strip_ddp_prefix"), **RIGHT}
    assert_all_pass("strip_ddp_prefix", verdicts("strip_ddp_prefix", answers, tmp_path))


def test_strip_not_attempted_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert exercises.evaluate("strip_ddp_prefix").outcome == "NOT ATTEMPTED"
    assert judge("strip_ddp_prefix", "x = 1\n", tmp_path).outcome != "PASS"


# ---------------------------------------------------------------- sharded_loader

SAMPLER = "DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,\n" \
          "                                 seed=0)"
LOADER = "DataLoader(dataset, batch_size=batch_size, sampler=sampler)"


def _sampler(new: str) -> str:
    return edit("sharded_loader", SAMPLER, new)


def _loader(new: str) -> str:
    return edit("sharded_loader", LOADER, new)


def _hand_sampler(pad: str) -> str:
    """A sampler written by hand: the sampler's shuffle and stride, with `pad` for padding."""
    return (
        "import torch\nfrom torch.utils.data import DataLoader\n\n\n"
        "class Shard:\n"
        "    def __init__(self, n, rank, world_size):\n"
        "        self.n, self.rank, self.world, self.epoch = n, rank, world_size, 0\n\n"
        "    def set_epoch(self, epoch):\n        self.epoch = epoch\n\n"
        "    def _indices(self):\n"
        "        g = torch.Generator().manual_seed(self.epoch)\n"
        "        order = torch.randperm(self.n, generator=g).tolist()\n"
        f"{pad}"
        "        return order[self.rank::self.world]\n\n"
        "    def __iter__(self):\n        return iter(self._indices())\n\n"
        "    def __len__(self):\n        return len(self._indices())\n\n\n"
        "def sharded_loader(dataset, rank, world_size, batch_size=64):\n"
        "    return DataLoader(dataset, batch_size=batch_size,\n"
        "                      sampler=Shard(len(dataset), rank, world_size))\n")


CYCLIC_PAD = ("        total = -(-self.n // self.world) * self.world\n"
              "        order = (order * total)[:total]  # repeat the order as often as needed\n")

LOADER_WRONG = {  # label: (answer, text its FAIL must name)
    "the sampler told shuffle=False": (
        _sampler(SAMPLER.replace("shuffle=True", "shuffle=False")),
        "12 samples, rank 0 of 2, epoch 0: sample 0: got image 0"),
    "the sampler told drop_last=True": (
        _sampler(SAMPLER.replace("seed=0)", "seed=0, drop_last=True)")),
        "10 samples, rank 0 of 3, epoch 0: got 3 samples, expected 4"),
    "shuffle=True kept beside the sampler": (
        _loader(LOADER.replace("sampler=sampler)", "sampler=sampler, shuffle=True)")),
        "raised ValueError: sampler option is mutually exclusive with shuffle"),
    "each rank seeded with its rank": (
        _sampler(SAMPLER.replace("seed=0)", "seed=rank)")), "12 samples, rank 1 of 2, epoch 0"),
    "the listing's batch size, 64, kept": (
        _loader(LOADER.replace("batch_size=batch_size", "batch_size=64")),
        "12 samples, rank 0 of 2: batch sizes (batch_size=4): got [6], expected [4, 2]"),
    "drop_last=True in the DataLoader": (
        _loader(LOADER.replace("sampler=sampler)", "sampler=sampler, drop_last=True)")),
        "12 samples, rank 0 of 2, epoch 0: got 4 samples, expected 6"),
    "the sampler's indices frozen into a Subset": (
        "from torch.utils.data import DataLoader, DistributedSampler, Subset\n\n\n"
        "def sharded_loader(dataset, rank, world_size, batch_size=64):\n"
        "    mine = list(DistributedSampler(dataset, world_size, rank, seed=0))\n"
        "    return DataLoader(Subset(dataset, mine), batch_size=batch_size)\n",
        "12 samples, rank 0 of 2, epoch 1: loader.sampler.set_epoch: got 'missing'"),
    "a contiguous block per rank, in order": (
        "from torch.utils.data import DataLoader, Subset\n\n\n"
        "def sharded_loader(dataset, rank, world_size, batch_size=64):\n"
        "    per = len(dataset) // world_size\n"
        "    mine = Subset(dataset, range(rank * per, (rank + 1) * per))\n"
        "    return DataLoader(mine, batch_size=batch_size)\n",
        "12 samples, rank 0 of 2, epoch 0: sample 0: got image 0"),
    # the world size written in: right on the 2-rank sizes, wrong on 3 and 5 ranks
    "num_replicas=2 written in": (
        _sampler(SAMPLER.replace("num_replicas=world_size", "num_replicas=2")),
        "10 samples, rank 0 of 3, epoch 0: got 5 samples, expected 4"),
    # rank and world size read from torchrun's variables instead of the arguments
    "RANK and WORLD_SIZE from the environment": (
        "import os\nfrom torch.utils.data import DataLoader, DistributedSampler\n\n\n"
        "def sharded_loader(dataset, rank, world_size, batch_size=64):\n"
        "    sampler = DistributedSampler(dataset, int(os.environ['WORLD_SIZE']),\n"
        "                                 int(os.environ['RANK']), seed=0)\n"
        "    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)\n",
        "12 samples, rank 0 of 2: raised KeyError: 'WORLD_SIZE'"),
    "a hand-made shard without padding": (
        _hand_sampler(""), "10 samples, rank 1 of 3, epoch 0: got 3 samples, expected 4"),
    "a hand-made shard padded once, not cyclically": (
        _hand_sampler("        total = -(-self.n // self.world) * self.world\n"
                      "        order += order[:total - self.n]\n"),
        "2 samples, rank 4 of 5, epoch 0: got 0 samples, expected 1"),
}

LOADER_RIGHT = {
    "positional arguments, the sampler's defaults, shuffle=False spelt out": (
        "from torch.utils.data import DataLoader, DistributedSampler\n\n\n"
        "def sharded_loader(dataset, rank, world_size, batch_size=64):\n"
        "    return DataLoader(dataset, batch_size, shuffle=False,\n"
        "                      sampler=DistributedSampler(dataset, world_size, rank))\n"),
    "a hand-made shard, padded cyclically": _hand_sampler(CYCLIC_PAD),
}


def test_wrong_loaders_fail_naming_the_case(tmp_path):
    lines = verdicts("sharded_loader", {k: src for k, (src, _) in LOADER_WRONG.items()}, tmp_path)
    assert_all_fail("sharded_loader", lines, {k: named for k, (_, named) in LOADER_WRONG.items()})


def test_loaders_written_differently_pass(tmp_path):
    answers = {"the kit's solution": exercises.solution_source("sharded_loader"), **LOADER_RIGHT}
    assert_all_pass("sharded_loader", verdicts("sharded_loader", answers, tmp_path))


# ---------------------------------------------------------------- lines_printed

WITHOUT = "lines without the sampler (4 ranks): "

LINES_WRONG = {  # label: (prediction, text its FAIL must name)
    "per rank, not in all": ((938, 235), WITHOUT + "got 938, expected 3752"),
    "the sampler not counted as sharding": ((3752, 3752), "lines with the sampler (4 ranks)"),
    "batches rounded down": ((3748, 936), WITHOUT + "got 3748"),
    "images over batch size, unrounded": ((3750, 937.5), "lines without the sampler"),
    "one line per image": ((240_000, 60_000), "lines without the sampler"),
    "swapped": ((940, 3752), WITHOUT + "got 940"),
    "with the sampler, one rank's lines": ((3752, 235), "lines with the sampler (4 ranks)"),
    "one number, not a pair": (4692, "the answer is a pair (without, with the sampler)"),
}


def test_wrong_lines_printed_predictions_fail_naming_the_count(tmp_path):
    lines = verdicts("lines_printed", {k: v for k, (v, _) in LINES_WRONG.items()}, tmp_path)
    assert_all_fail("lines_printed", lines, {k: named for k, (_, named) in LINES_WRONG.items()})
    exercises._CHECKED.discard("lines_printed")


def test_lines_printed_spelt_differently_passes(tmp_path):
    answers = {"a tuple": (3752, 940), "a list": [3752, 940], "floats": (3752.0, 940.0),
               "the arithmetic": (4 * 938, 4 * 235)}
    assert_all_pass("lines_printed", verdicts("lines_printed", answers, tmp_path))
    exercises._CHECKED.discard("lines_printed")
