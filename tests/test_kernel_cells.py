"""%%ranks in a real Jupyter kernel, as a frontend sees it (jupyter_client, iopub messages): the
live view of a long cell, nothing extra for a fast one, the stop button's one sentence, the
line the last `%ranks stop` of a lesson prints, every cell named by the number its prompt
shows, and pdb on a rank driven through the notebook's input box (input_request answered as a
person would)."""

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


def run(kc, code: str, timeout: float = 120, interrupt_after=None, km=None,
        answers: list[str] | None = None) -> list[dict]:
    """Execute `code`; every iopub message of that execution, until the kernel is idle. With
    `answers`, stdin is on and each input_request is answered with the next one (its prompt
    is recorded as a message of type "input_request")."""
    msg_id = kc.execute(code, allow_stdin=answers is not None)
    messages, start, interrupted = [], time.monotonic(), False
    answers = list(answers or [])
    while True:
        if answers is not None and kc.stdin_channel.msg_ready():
            request = kc.get_stdin_msg(timeout=1)
            messages.append({"msg_type": "input_request", "content": request["content"],
                             "parent_header": request["parent_header"]})
            kc.input(answers.pop(0) if answers else "q")
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
    n = prompt_number(messages)  # the live view names the cell as its prompt shows it
    assert f"rank 0: In [{n}], line 4: time.sleep(4)" in first, first
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


def text_of(messages) -> str:
    """What the cell showed: its streams, its error's text, and the prompts it asked with."""
    parts = []
    for m in messages:
        c = m["content"]
        if m["msg_type"] == "stream":
            parts.append(c["text"])
        elif m["msg_type"] == "error":
            parts.append("\n".join(c["traceback"]))
        elif m["msg_type"] == "input_request":
            parts.append(f"<asked: {c['prompt']}>")
    return "".join(parts)


def prompt_number(messages) -> int:
    return next(m["content"]["execution_count"] for m in messages
                if m["msg_type"] == "execute_input")


@pytest.fixture
def ranks(kernel):
    """Fresh ranks in the module's kernel, stopped when the test ends (none outlives it)."""
    _, kc = kernel
    run(kc, "%ranks start 2 --output none --backend gloo")
    yield kc
    run(kc, "%ranks stop")


def test_every_cell_is_named_by_the_number_its_prompt_shows(ranks):
    kc = ranks
    raised = run(kc, "%%ranks\nif rank == 1:\n    raise ValueError('bad shard')\n")
    n = prompt_number(raised)
    assert f'File "<cell In [{n}]>", line 3' in text_of(raised), text_of(raised)
    mismatch = run(kc, "%%ranks\nif rank == 0:\n    dist.barrier()\n")
    n = prompt_number(mismatch)
    assert f"rank 0 is in barrier #1 (In [{n}], line 3)" in text_of(mismatch)
    ledger = run(kc, "%%ranks --ledger\nt = torch.ones(2)\ndist.all_reduce(t)\n")
    assert f"Collectives of In [{prompt_number(ledger)}]" in text_of(ledger)


def test_post_mortem_in_the_notebook_reads_rank_1s_variables_and_the_ranks_go_on(ranks):
    kc = ranks
    run(kc, "%%ranks\nkept = rank + 100\n")
    failed = run(kc, "%%ranks\nx = torch.tensor([1.0, float('nan')]) * rank\nloss = x.sum()\n"
                     "if loss.isnan():\n    raise ValueError('loss is NaN')\n")
    n = prompt_number(failed)
    session = run(kc, "%ranks debug 1", answers=["p loss", "p x", "p kept", "q"])
    shown = text_of(session)
    prompts = [m for m in session if m["msg_type"] == "input_request"]
    assert len(prompts) == 4 and prompts[0]["content"]["prompt"] == "(Pdb rank 1) "
    assert f"Post-mortem of rank 1, where In [{n}] raised" in shown
    assert f"> In [{n}], line 5, <module>()" in shown, shown
    assert "tensor(nan)" in shown and "tensor([1., nan])" in shown and "101" in shown
    after = run(kc, "%%ranks\nt = torch.tensor([float(kept)])\ndist.all_reduce(t)\nt.item()\n")
    assert "[rank 0] Out: 201.0" in text_of(after) and "[rank 1] Out: 201.0" in text_of(after)


def test_a_check_tries_a_second_world_size_with_the_learners_own_cells(ranks):
    kc = ranks
    from ddp_helpers import exercises

    solution = exercises.solution_source("naive_all_reduce")
    run(kc, "import ddp_helpers as dh")
    run(kc, "%%ranks\nN = dist.get_world_size()\n")
    written_in = run(kc, "%%ranks\n" + solution.replace("range(1, world_size)", "range(1, 2)"))
    n = prompt_number(written_in)
    failed = text_of(run(kc, 'dh.check("naive_all_reduce")'))
    assert failed.startswith("FAIL naive_all_reduce: world size 3: your answer failed on 3 "
                             "ranks"), failed
    assert f"(In [{n}], line " in failed, failed  # the learner's cell, as the prompt names it
    run(kc, "%%ranks\n" + solution.replace("range(1, world_size)", "range(1, N)"))
    passed = text_of(run(kc, 'dh.check("naive_all_reduce")'))
    assert passed.strip().endswith("cases at world sizes 2 and 3"), passed
