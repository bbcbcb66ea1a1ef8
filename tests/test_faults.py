"""The fault campaign as tests: a clear error naming the rank, nothing left, next launch works."""

import re

import pytest

from bench.fault_campaign import CASES, run_case


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault(case):
    outcome = run_case(case)
    if case.expect is type(None):
        assert outcome.error is None, outcome.error
    else:
        assert isinstance(outcome.error, case.expect), repr(outcome.error)
        # (KeyboardInterrupt's case matches "": the interrupt carries no text of its own)
        assert re.search(case.match, str(outcome.error)), str(outcome.error)
    assert outcome.left == 0, "processes were left behind"
    assert outcome.next_ok, "the next launch failed"
