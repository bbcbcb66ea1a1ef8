"""Lesson 11: tensor and pipeline parallelism on real gloo ranks. The numbers the notebook shows
(equivalence with the unsplit model, collectives and bytes, the bubble counted in slots, memory
per rank against the formulas). Its three exercises' checks, wrong answers and right ones, are
tested in tests/test_exercise_tensor_and_pipeline_parallel.py."""

import json
from pathlib import Path

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers.lessons import tensor_and_pipeline_parallel as lesson

SETUP = "import torch.nn.functional as F\n" \
        "import torch\n" \
        "from ddp_helpers.lessons import tensor_and_pipeline_parallel as lesson"


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(2, timeout=90, output="none") as p:
        p.run(SETUP)
        yield p


@pytest.fixture(scope="module")
def pool3():
    with dh.Ranks(3, timeout=90, output="none") as p:
        p.run(SETUP)
        yield p


# ---------------------------------------------------------------- tensor parallel: the numbers

BY_HAND = """
block = lesson.mlp_block(seed=0)
x, dy = lesson.block_input()
W1, W2 = block[0].weight.detach(), block[2].weight.detach()
w1 = W1.chunk(world_size, dim=0)[rank].clone().requires_grad_()
b1 = block[0].bias.detach().chunk(world_size)[rank].clone().requires_grad_()
w2 = W2.chunk(world_size, dim=1)[rank].clone().requires_grad_()
b2 = block[2].bias.detach().clone().requires_grad_()
x_in = x.clone().requires_grad_()
with lesson.CollectiveLog() as forward:
    h = F.gelu(F.linear(lesson.copy_to_ranks(x_in), w1, b1))
    y = lesson.sum_over_ranks(F.linear(h, w2)) + b2
with lesson.CollectiveLog() as backward:
    y.backward(dy)
forward.summary(), backward.summary(), lesson.compare_with_unsplit(
    {"y": y, "x": x_in.grad, "w1": w1.grad, "b1": b1.grad, "w2": w2.grad, "b2": b2.grad},
    rank, world_size)
"""
ALL_EQUAL = "; ".join(f"{k}: equal within rtol=1e-05, atol=1e-06: True"
                      for k in ("y", "x", "w1", "b1", "w2", "b2"))


@pytest.mark.parametrize("n", [2, 3])
def test_megatron_split_by_hand_sends_one_all_reduce_each_way_and_equals_the_block(
        n, pool, pool3):
    for fwd, bwd, equal in {2: pool, 3: pool3}[n].run(BY_HAND):
        assert fwd == {"all_reduce": (1, lesson.BATCH * lesson.D * 4)} == bwd
        assert equal == ALL_EQUAL


@pytest.mark.parametrize("n", [2, 3])
def test_rows_first_sends_an_all_reduce_of_the_hidden_layer_and_an_all_gather(n, pool, pool3):
    got = {2: pool, 3: pool3}[n].run(
        "x, _ = lesson.block_input()\nwith lesson.CollectiveLog() as log:\n"
        "    y = lesson.rows_first_forward(lesson.mlp_block(0), x, rank, world_size)\n"
        "log.summary(), lesson.compare_with_unsplit({'y': y}, rank, world_size)")
    for summary, equal in got:
        assert summary == {"all_reduce": (1, lesson.BATCH * lesson.HIDDEN * 4),
                           "all_gather": (1, lesson.BATCH * -(-lesson.D // n) * 4)}  # padded
        assert equal == "y: equal within rtol=1e-05, atol=1e-06: True"


def test_dtensor_shards_like_megatron_and_sends_what_the_hand_split_sends(pool):
    got = pool.run("""
tp = lesson.parallel_block(device)
x, dy = lesson.block_input()
x_dt = x.clone().requires_grad_()
with lesson.CollectiveLog() as fwd:
    y = tp(x_dt)
with lesson.CollectiveLog() as bwd:
    y.backward(dy)
(lesson.describe_parameter(tp[0].weight), lesson.describe_parameter(tp[2].weight),
 fwd.summary(), bwd.summary(), lesson.compare_with_unsplit(
    {"y": y, "x": x_dt.grad, "w1": tp[0].weight.grad, "b1": tp[0].bias.grad,
     "w2": tp[2].weight.grad, "b2": tp[2].bias.grad}, rank, world_size))
""")
    for w1, w2, fwd, bwd, equal in got:
        assert w1 == "DTensor: global (64, 16), placements (Shard(dim=0),), local shard (32, 16)"
        assert w2 == "DTensor: global (16, 64), placements (Shard(dim=1),), local shard (16, 32)"
        assert fwd == bwd == {"all_reduce": (1, 512)}
        assert equal == ALL_EQUAL


def test_the_log_counts_every_way_of_calling_a_collective(pool):
    got = pool.run("""
from torch.distributed import all_reduce as ar
import torch.distributed._functional_collectives as funcol
with lesson.CollectiveLog() as log:
    t = torch.ones(4)
    dist.all_reduce(t); ar(t); funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
    dist.all_reduce(t, async_op=True).wait()
log.summary()
""")
    assert got == [{"all_reduce": (4, 64)}] * 2


# ---------------------------------------------------------------- pipeline parallel: the numbers


def test_pipelines_equal_the_unsplit_model_and_their_bubble_is_the_formula(pool, pool3):
    for p in (pool, pool3):
        _pipelines_equal_the_unsplit_model(p)


def _pipelines_equal_the_unsplit_model(p):
    runs = p.run("lesson.schedule_runs(rank, world_size, timed=False)")
    stages = p.nprocs
    per_run = lesson.by_run(runs)
    assert [(r[0]["schedule"], r[0]["m"]) for r in per_run] == [
        (s, m) for s in ("GPipe", "1F1B (the kit's solution)") for m in lesson.MICROBATCHES]
    for per_rank in per_run:
        m = per_rank[0]["m"]
        assert all(r["grads_equal"] for r in per_rank)
        assert lesson.bubble_from_slots(lesson.slots_of(per_rank)) == pytest.approx(
            (stages - 1) / (m + stages - 1), abs=1e-12)
        act = lesson.PIPE_BATCH * lesson.WIDTH * 4  # one direction, all micro-batches
        for rank, r in enumerate(per_rank):
            ends = (rank == 0) + (rank == stages - 1)
            assert r["collectives"] == {"recv": (m * (2 - ends), act * (2 - ends)),
                                        "send": (m * (2 - ends), act * (2 - ends))}
            gpipe = r["schedule"] == "GPipe"
            assert lesson.peak_in_flight(r["order"]) == (m if gpipe else min(stages - rank, m))


def test_pipeline_memory_equals_the_formulas(pool):
    for m in (2, 4):
        runs = pool.run(f"lesson.memory_runs(rank, world_size, num_microbatches={m})")
        want = lesson.pp_formulas(2, m)
        for rank, (gpipe, f1b) in enumerate(runs):
            assert gpipe["parameters"] == f1b["parameters"] == want[rank]["parameters"]
            assert gpipe["peak_activations"] == want[rank]["gpipe"]
            assert f1b["peak_activations"] == want[rank]["1f1b"]
    whole = lesson.unsplit_pipeline_memory()
    assert whole == {"parameters": 2 * want[0]["parameters"],
                     "activations": 4 * lesson.PIPE_BATCH * lesson.WIDTH * (lesson.BLOCKS + 2)}


def test_tensor_parallel_memory_equals_the_formulas(pool):
    want = lesson.tp_formulas(2)
    for mem in pool.run("lesson.tp_memory(rank, world_size, device)"):
        assert mem == {"unsplit": want["unsplit"], "by hand": want["split"],
                       "DTensor": want["split"]}
    assert want == {"unsplit": {"parameters": 8512, "activations": 4608},
                    "split": {"parameters": 4288, "activations": 2560}}


def test_the_timed_runs_are_deterministic_where_the_notebook_compares_them(pool):
    runs = pool.run("lesson.schedule_runs(rank, world_size, microbatches=(2,))")
    assert lesson.describe_ran(runs).endswith(": yes")
    text = lesson.describe_runs(runs)
    assert "GPipe                         2  yes           2 x send,  2 x recv,   524,288 B" in text
    assert text.splitlines()[1].endswith("0.333")


def test_torch_pipelining_sends_what_the_hand_written_gpipe_sends(pool):
    status = pool.run("lesson.pipelining_status()")
    if status[0] != "runs":  # an older torch without the gloo fix: said so, and not run
        assert any(why in status[0] for why in ("pytorch#132644", "no torch.distributed.pipelining",
                                                "the kit runs them from torch 2.14"))
        return
    records = pool.run("lesson.torch_gpipe(rank, world_size, device)")
    for r in records:
        assert r["grads_equal"]
        assert r["collectives"] == {"recv": (4, 4096), "send": (4, 4096)}
    assert lesson.describe_torch_gpipe(records).splitlines()[0].endswith(": yes")


def test_simulate_refuses_orders_that_deadlock_or_are_not_schedules():
    # stage 0 waits for micro-batch 0's gradient before sending micro-batch 1, which stage 1
    # wants first
    with pytest.raises(ValueError, match=r"deadlock: stage 0 at \('B', 0\), stage 1 at "
                                         r"\('F', 1\)"):
        lesson.simulate([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                         [("F", 1), ("B", 1), ("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="comes before"):
        lesson.simulate([[("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match="one F and one B"):
        lesson.simulate([[("F", 0)]])
    slots = lesson.simulate([lesson.gpipe(s, 2, 2) for s in range(2)])
    assert slots == [[("F", 0, 0), ("F", 1, 1), ("B", 0, 4), ("B", 1, 5)],
                     [("F", 0, 1), ("F", 1, 2), ("B", 0, 3), ("B", 1, 4)]]


def test_saved_activations_are_counted_once_and_released():
    model = lesson.pipeline_model(0)
    x = torch.randn(4, lesson.WIDTH)
    with lesson.SavedActivations(model.parameters()) as saved:
        out = model(x).sum()
    assert saved.peak == saved.live == 4 * 4 * lesson.WIDTH * (lesson.BLOCKS + 1)
    out.backward()
    assert saved.live == 0


def test_a_gloo_send_waits_for_the_matching_recv(pool):
    # rank 1 posts its recv 1 s after the barrier: the send cannot return before it (load on
    # the machine only makes it later)
    assert pool.run("lesson.send_waits_for_recv(rank)") == [
        "my blocking send of 4 bytes returned only after rank 1 posted its recv 1 s late: True",
        "posted my recv 1 s after the barrier"]


# ------------------------------------------- the notebook's attention and sequence-parallel cells

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "11_tensor_and_pipeline_parallel.ipynb"


def notebook_cell(first_line: str) -> str:
    """The body of the notebook's %%ranks cell whose code starts with `first_line` (after the
    magic's line), so that these tests run what the learner runs."""
    for c in json.loads(NOTEBOOK.read_text())["cells"]:
        source = "".join(c["source"])
        if c["cell_type"] == "code" and source.startswith("%%ranks"):
            body = source.split("\n", 1)[1]
            if body.startswith(first_line):
                return body
    raise AssertionError(f"no %%ranks cell starts with {first_line!r}")


@pytest.mark.parametrize("n", [2, 3])
def test_attention_by_heads_equals_the_layer_and_a_layer_sends_two_all_reduces_each_way(
        n, pool, pool3):
    p = {2: pool, 3: pool3}[n]
    bsh = 4 * lesson.SEQ_BATCH * lesson.SEQ_LEN * lesson.SEQ_D
    assert p.run(notebook_cell("attn = lesson.attention_layer")) == \
        [(f"all_reduce x1 ({bsh:,} B)",) * 2] * n
    for line in p.run(notebook_cell("lesson.compare_attention(")):
        assert line.startswith("out, x, wq, bq, wk, bk, wv, bv, wo, bo equal") and "NOT" not in line
    assert p.run(notebook_cell("lesson.layer_collectives(")) == [
        f"forward: all_reduce x2 of {2 * bsh:,} B; backward: all_reduce x2 of {2 * bsh:,} B; "
        f"2 x b·s·h = 2 x 2·6·24 floats = 2 x {bsh:,} B each way"] * n
    assert p.run(notebook_cell("ones = torch.ones(")) == [
        "the same mask on every rank? outside (replicated, one seed): True; inside (my shard, "
        "seed + 2718 + rank): False; inside with one seed for all: True"] * n


@pytest.mark.parametrize("n", [2, 3])
def test_sequence_parallel_gathers_and_scatters_and_equals_the_block(n, pool, pool3):
    p = {2: pool, 3: pool3}[n]
    p.run(notebook_cell("from torch.distributed.device_mesh import init_device_mesh"))
    bsh = 4 * lesson.SEQ_BATCH * lesson.SEQ_LEN * lesson.SEQ_D
    calls = f"all_gather x1 ({bsh // n:,} B), reduce_scatter x1 ({bsh:,} B)"
    assert p.run(notebook_cell("from torch.distributed.tensor import Shard")) == [(calls,) * 2] * n
    for placements, summed, compared in p.run(notebook_cell("g_norm = sp_block[0]")):
        assert str(placements) == "(Partial(sum),)"
        assert summed == f"all_reduce x1 ({4 * lesson.SEQ_D} B)"
        assert compared == ("y (my positions): True; dL/dx (my positions): True; w1 (my rows): "
                            "True; w2 (my columns): True; LayerNorm weight, local: False; "
                            "LayerNorm weight, full_tensor(): True")
    measured = p.run("lesson.sp_memory(rank, world_size, device)")
    assert measured == [lesson.sp_formulas(n)] * n
    assert measured[0]["TP + SP"] < measured[0]["TP"] < measured[0]["unsplit"]


def test_the_notebooks_torch_schedules_run_or_say_why_not(pool):
    pool.run("x_all, target_all = (t.to(device) for t in lesson.pipeline_batch())")
    pool.run(notebook_cell("from torch.distributed.pipelining import PipelineStage"))
    text = lesson.describe_torch_pipelining(pool.run("torch_pp"))
    if pool.run("lesson.pipelining_status()")[0] != "runs":  # the floor: the reason, sourced
        assert text.startswith("not run on torch ") and "_get_init_p2p_neighbors_ops" in text
        return
    step = "second step recv x4 of 4,096 B, send x4 of 4,096 B"
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        assert f"{name}, 4 micro-batches: gradients equal the unsplit model's on every rank: " \
               "yes" in text
    assert text.count(step) == 4, text


@pytest.mark.parametrize("p,v,m", [(2, 1, 4), (2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 4, 8),
                                   (2, 3, 2)])
def test_interleaved_1f1b_counted_in_slots_is_the_formula(p, v, m):
    c = lesson.interleaved_counts(p, v, m)
    assert c["bubble"] == pytest.approx((p - 1) / (v * m))
    assert c["sends"] == 2 * m * (p * v - 1)
    orders = [lesson.interleaved_order(r, p, v, m) for r in range(p)]
    for order in orders:  # every chunk's forward and backward of every micro-batch, once
        assert sorted(order) == sorted((k, c_, i) for k in "FB" for c_ in range(v)
                                       for i in range(m))
    if v == 1:  # one chunk per rank: the same bubble as the lesson's 1F1B over the ideal time
        ones = lesson.simulate([lesson.solution_module("one_f_one_b").one_f_one_b(s, p, m)
                                for s in range(p)])
        span = max(start + 1 for ops in ones for *_, start in ops)
        assert (span - 2 * m) / (2 * m) == pytest.approx(c["bubble"])


def test_interleaved_needs_m_a_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of p"):
        lesson.interleaved_order(0, 2, 2, 3)


# ------------------------------------------- the notebook's vocabulary cells, by hand and torch's


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_owns_some_of_the_tokens_and_of_the_targets(n):
    tokens, targets = lesson.token_batch()
    for rank in range(n):
        lo, hi = lesson.vocab_range(rank, n)
        assert hi - lo == lesson.VOCAB // n
        for ids in (tokens, targets):  # else a rank's mask would hide nothing, its row no one's
            assert ((ids >= lo) & (ids < hi)).any() and ((ids < lo) | (ids >= hi)).any()


@pytest.mark.parametrize("n", [2, 3])
def test_vocabulary_split_by_hand_equals_the_whole_and_the_loss_sends_three_all_reduces(
        n, pool, pool3):
    p = {2: pool, 3: pool3}[n]
    p.run("xa, dya = lesson.sequence_input()")  # what the attention cell leaves behind
    bs = lesson.SEQ_BATCH * lesson.SEQ_LEN
    bsh = 4 * bs * lesson.SEQ_D
    assert p.run(notebook_cell("tokens, targets = ")) == [
        (f"all_reduce x1 ({bsh:,} B)",
         "e, w_emb equal the unsplit embedding's within rtol=1e-05, atol=1e-06")] * n
    assert p.run(notebook_cell("head = lesson.vocab_model")) == [
        (lesson.SEQ_BATCH, lesson.SEQ_LEN, lesson.VOCAB // n)] * n
    assert p.run(notebook_cell("with lesson.CollectiveLog() as ce_forward")) == [
        f"all_reduce x3 ({3 * 4 * bs} B)"] * n
    assert p.run(notebook_cell("with lesson.CollectiveLog() as ce_backward")) == [
        (f"all_reduce x1 ({bsh:,} B)", "loss, h, w_head equal F.cross_entropy's on the whole "
         "logits within rtol=1e-05, atol=1e-06")] * n


@pytest.mark.parametrize("n", [2, 3])
def test_torchs_vocabulary_parallel_sends_what_the_hand_split_sends(n, pool, pool3):
    p = {2: pool, 3: pool3}[n]
    p.run(notebook_cell("from torch.distributed.device_mesh import init_device_mesh"))
    p.run("from torch.distributed.tensor import Shard\n"
          "tokens, targets = lesson.token_batch()")
    bs = lesson.SEQ_BATCH * lesson.SEQ_LEN
    bsh = 4 * bs * lesson.SEQ_D
    for placements, fwd, bwd in p.run(notebook_cell("from torch.distributed.tensor import Repl")):
        assert str(placements) == "(Shard(dim=2),)"
        assert fwd == f"all_reduce x4 ({bsh + 3 * 4 * bs:,} B)"
        assert bwd == f"all_reduce x1 ({bsh:,} B)"
    for weight, grad, compared in p.run(notebook_cell("(lm.emb.weight.placements")):
        assert (str(weight), str(grad)) == ("(Shard(dim=0),)", "(Replicate(),)")
        assert compared == ("loss, emb grad, head grad equal the unsplit model's within "
                            "rtol=1e-05, atol=1e-06")


@pytest.mark.parametrize("n", [2, 3])
def test_the_typed_gpipe_loop_equals_the_unsplit_model_its_messages_counted(n, pool, pool3):
    p = {2: pool, 3: pool3}[n]
    p.run(notebook_cell("model = lesson.pipeline_model(seed=0)"))
    act = "x4 (4,096 B)"  # 4 micro-batches of 4 x 64 float32
    forward = [f"send {act}"] + [f"recv {act}, send {act}"] * (n - 2) + [f"recv {act}"]
    assert p.run(notebook_cell("def post(ops)")) == forward
    assert p.run(notebook_cell("sends = []")) == forward[::-1]
    assert p.run(notebook_cell("lesson.compare_stage_grads(")) == [
        "my stage's gradients, summed over the micro-batches, equal the unsplit model's on the "
        "whole batch within rtol=1e-05, atol=1e-06: True"] * n


def test_at_three_ranks_the_dtensor_mlp_runs_on_its_uneven_split(pool3):
    # 64 hidden features over 3 ranks are 22, 22 and 20: the notebook's plan keeps the hidden
    # activation a DTensor (use_local_output=False, input_layouts=Shard(-1)), so no
    # DTensor.from_local guesses even shards; the counts are the 2-rank ones, per rank
    pool3.run(notebook_cell("import torch.nn.functional as F"))
    shards = pool3.run(notebook_cell("from torch.distributed.device_mesh import init_device_mesh"))
    assert [r.split("local shard ")[1] for r in shards] == ["(22, 16)", "(22, 16)", "(20, 16)"]
    assert pool3.run(notebook_cell("x_dt = x.clone().requires_grad_()")) == \
        [("all_reduce x1 (512 B)", "all_reduce x1 (512 B)")] * 3
    for line in pool3.run(notebook_cell("lesson.compare_with_unsplit({\"y\": y_dt")):
        assert line.count(": True") == 6, line
    memory = pool3.run("lesson.tp_memory(rank, world_size, device)")
    assert [m["DTensor"]["parameters"] for m in memory] == \
        [m["by hand"]["parameters"] for m in memory]
    # each rank at its own share's formula (22, 22, 20 hidden features), as the table says
    assert [m["DTensor"] for m in memory] == [lesson.tp_formulas(3, rank=r)["split"]
                                               for r in range(3)]


def test_the_tracer_cuts_where_the_split_point_says_or_says_why_not():
    text = lesson.traced_stages(split_at=3)
    if text.startswith("not run on torch"):
        assert "pipeline() tracer" in text and "2.14" in text  # the floor's path, said
        return
    assert "2 stages" in text and "stage 1: 6 tensors, 3.0.weight ... 5.0.bias" in text
    assert text.endswith("(rtol=1e-05, atol=1e-06): True")
