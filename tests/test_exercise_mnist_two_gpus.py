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
