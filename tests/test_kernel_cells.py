"""%%ranks in a real Jupyter kernel, as a frontend sees it (jupyter_client, iopub messages): the
live view of a long cell, nothing extra for a fast one, the stop button's one sentence, and the
line the last `%ranks stop` of a lesson prints."""

import time

import pytest
from jupyter_client.manager import start_new_kernel


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3", env=_env())
    try:
        run(kc, "%load_ext ddp_helpers\n%ranks start 2 --output none --backend gloo")
        yield km, kc
    finally:
        run(kc, "%ranks stop", timeout=60)
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def _env():
    import os

    # The view is for a person at the frontend; forced on here (this client cannot take input).
    return {**os.environ, "DDP_HELPERS_LIVE_VIEW": "1"}


def run(kc, code: str, timeout: float = 120, interrupt_after=None, km=None) -> list[dict]:
    """Execute `code`; every iopub message of that execution, until the kernel is idle."""
    msg_id = kc.execute(code, allow_stdin=False)
    messages, start, interrupted = [], time.monotonic(), False
    while True:
        if interrupt_after and not interrupted and time.monotonic() - start > interrupt_after:
            km.interrupt_kernel()  # the notebook's stop button
            interrupted = True
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
            assert time.monotonic() - start < timeout, f"no idle after {timeout} s: {messages}"
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)


def displays(messages) -> list[tuple[str, str, str]]:
    """(msg_type, display_id, text) of every display message."""
    return [(m["msg_type"], m["content"].get("transient", {}).get("display_id"),
             m["content"]["data"].get("text/plain", ""))
            for m in messages if m["msg_type"] in ("display_data", "update_display_data")]


def test_a_long_cell_shows_where_each_rank_is_then_the_view_empties(kernel):
    _, kc = kernel
    messages = run(kc, "%%ranks\nimport time\nif rank == 0:\n    time.sleep(4)\n"
                       "dist.all_reduce(torch.ones(3))\n")
    shown = displays(messages)
    assert shown and shown[0][0] == "display_data", shown
    first = shown[0][2]
    assert "rank 0: In [" in first and "line 4: time.sleep(4)" in first, first
    assert "line 5: dist.all_reduce(torch.ones(3))" in first, first
    assert "entered all_reduce #1 float32[3]" in first, first
    assert {d for _, d, _ in shown} == {shown[0][1]}, "every update goes to the one view"
    assert shown[-1][0] == "update_display_data" and shown[-1][2] == "", shown[-1]
    assert not [m for m in messages if m["msg_type"] == "error"]


def test_a_fast_cell_shows_no_view(kernel):
    _, kc = kernel
    messages = run(kc, "%%ranks\nt = torch.ones(2)\ndist.all_reduce(t)\n")
    assert displays(messages) == []


def test_a_batch_run_never_shows_the_view(kernel):
    """nbconvert, nbclient and nbval send cells with stdin off: no view, whatever the speed."""
    _, kc = kernel
    run(kc, "import os\nos.environ.pop('DDP_HELPERS_LIVE_VIEW')")
    try:
        messages = run(kc, "%%ranks\nimport time\ntime.sleep(3)\n")
    finally:
        run(kc, "os.environ['DDP_HELPERS_LIVE_VIEW'] = '1'")
    assert displays(messages) == []


def test_the_stop_button_shows_one_sentence_and_the_next_cell_works(kernel):
    km, kc = kernel
    messages = run(kc, "%%ranks\nimport time\ntime.sleep(120)\n", interrupt_after=3, km=km)
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert len(errors) == 1, messages
    text = "\n".join(errors[0]["traceback"])
    assert "Every rank was stopped (the cell was interrupted)" in text, text
    assert len(errors[0]["traceback"]) == 1, text  # no frames of the kit (or of anyone)
    for kit_file in ("ranks.py", "supervisor.py", "watch.py", "magic.py"):
        assert kit_file not in text
    after = run(kc, "%%ranks\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt\n")
    out = "".join(m["content"].get("text", "") for m in after if m["msg_type"] == "stream")
    assert "starting 2 fresh ranks" in out and "[rank 1] Out: tensor([3.])" in out, out
    run(kc, "%ranks stop")  # the fresh ranks are this test's: none outlives it


def test_stop_says_how_to_get_the_ranks_back_and_every_refusal_agrees(kernel):
    _, kc = kernel
    stopped = run(kc, "%ranks stop")
    said = "".join(m["content"].get("text", "") for m in stopped if m["msg_type"] == "stream")
    assert "the 2 ranks were stopped" in said and "`%ranks start 2`" in said, said
    refused = run(kc, "%%ranks\n1\n")
    error = [m["content"] for m in refused if m["msg_type"] == "error"][0]
    assert "`%ranks start 2`" in error["evalue"], error["evalue"]
    checked = run(kc, "import ddp_helpers as dh\ndh.check('naive_all_reduce')")
    said = "".join(m["content"].get("text", "") for m in checked if m["msg_type"] == "stream")
    assert said.startswith("NOT ATTEMPTED naive_all_reduce: no ranks are running: "
                           "`%ranks start 2`"), said
