"""Lesson 02's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS."""

from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

READ = 'return {name: int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}'

ENV_WRONG = {  # label: (answer, text its FAIL must name)
    "strings, not ints": (edit("env_report", "int(os.environ[name])", "os.environ[name]"),
                          "2 ranks, rank 0: got {'RANK': '0'"),
    "rank and world size from the arguments": (
        edit("env_report", READ, 'return {"RANK": rank, "WORLD_SIZE": world_size, '
             '"MASTER_PORT": int(os.environ["MASTER_PORT"])}'),
        "3 ranks, rank 0 (called with rank=-1, world_size=-1, 2 ranks per node): got "
        "{'RANK': -1"),
    "LOCAL_RANK and LOCAL_WORLD_SIZE for the global values": (
        edit("env_report", READ, 'return {"RANK": int(os.environ["LOCAL_RANK"]), '
             '"WORLD_SIZE": int(os.environ["LOCAL_WORLD_SIZE"]), '
             '"MASTER_PORT": int(os.environ["MASTER_PORT"])}'),
        "3 ranks, rank 0 (called with rank=-1, world_size=-1, 2 ranks per node): got "
        "{'RANK': 0, 'WORLD_SIZE': 2"),
    "the default port": (edit("env_report", READ, 'return {"RANK": int(os.environ["RANK"]), '
                              '"WORLD_SIZE": int(os.environ["WORLD_SIZE"]), '
                              '"MASTER_PORT": 29500}'), "2 ranks, rank 0: got"),
    "lower-case keys": (edit("env_report", "{name: int", "{name.lower(): int"),
                        "2 ranks, rank 0: got {'rank': 0"),
    "MASTER_ADDR for the port": (edit("env_report", '"MASTER_PORT")', '"MASTER_ADDR")'),
                                 "rank 0 of 2 raised ValueError"),
}

ENV_RIGHT = {
    "getenv, a dict literal": edit(
        "env_report", READ, 'return {"WORLD_SIZE": int(os.getenv("WORLD_SIZE")), '
        '"RANK": int(os.getenv("RANK")), "MASTER_PORT": int(os.getenv("MASTER_PORT"))}'),
    "a loop filling a dict": edit(
        "env_report", READ, 'out = {}\n    for key in ["MASTER_PORT", "RANK", "WORLD_SIZE"]:\n'
        '        out[key] = int(os.environ.get(key, "-1"))\n    return out'),
}

LOWER = "if not any(word in message.lower() for word in KNOCK_ON)"
ROOT_WRONG = {
    "the first listed, not the lowest": (
        edit("root_cause_rank", "return min(own) if own else None",
             "return own[0] if own else None"), "errors {3: \"KeyError: 'lr'\""),
    "the highest": (edit("root_cause_rank", "min(own)", "max(own)"),
                    "'Connection Reset by peer'}: got 3, expected 1"),
    "letter case matters": (edit("root_cause_rank", LOWER,
                                 "if not any(word in message for word in "
                                 "('Connection reset', 'Connection closed', 'timed out'))"),
                            "errors {3: \"KeyError: 'lr'\", 1: 'ValueError: corrupt batch', "
                            "0: 'Connection Reset by peer'}: got 0, expected 1"),
    "rank 0 when every error is a knock-on": (
        edit("root_cause_rank", "return min(own) if own else None",
             "return min(own) if own else min(errors)"), "got 0, expected None"),
    "timeouts are not knock-ons": (
        edit("root_cause_rank", '"connection closed", "timed out")', '"connection closed")'),
        "errors {0: 'DistBackendError: barrier timed out after 60 s'"),
    "the whole message must match": (
        edit("root_cause_rank", "not any(word in message.lower()",
             "not any(word == message.lower()"),
        "errors {0: 'RuntimeError: Connection reset by peer', 1: 'ValueError: corrupt batch'}"),
}

ROOT_RIGHT = {
    "a sorted loop, returning early": (
        "def root_cause_rank(errors):\n    for rank in sorted(errors):\n"
        "        text = errors[rank].casefold()\n"
        "        if 'connection reset' in text or 'connection closed' in text or "
        "'timed out' in text:\n            continue\n        return rank\n    return None\n"),
    "a regex": (
        "import re\n\nKNOCK = re.compile(r'connection (reset|closed)|timed out', re.I)\n\n\n"
        "def root_cause_rank(errors):\n    own = sorted(r for r, m in errors.items() "
        "if not KNOCK.search(m))\n    return own[0] if own else None\n"),
}


def test_wrong_env_reports_fail_naming_the_case(tmp_path):
    lines = verdicts("env_report", {k: src for k, (src, _) in ENV_WRONG.items()}, tmp_path)
    assert_all_fail("env_report", lines, {k: named for k, (_, named) in ENV_WRONG.items()})


def test_env_reports_written_differently_pass(tmp_path):
    assert_all_pass("env_report", verdicts("env_report", ENV_RIGHT, tmp_path))


def test_wrong_root_causes_fail_naming_the_case(tmp_path):
    lines = verdicts("root_cause_rank", {k: src for k, (src, _) in ROOT_WRONG.items()},
                     tmp_path)
    assert_all_fail("root_cause_rank", lines,
                    {k: named for k, (_, named) in ROOT_WRONG.items()})


def test_root_causes_written_differently_pass(tmp_path):
    assert_all_pass("root_cause_rank", verdicts("root_cause_rank", ROOT_RIGHT, tmp_path))
