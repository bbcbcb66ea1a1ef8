"""Lesson 11: a model split across ranks, two ways, built from the primitives on CPU ranks.

Tensor parallelism splits each layer: Megatron-LM's MLP block, the first Linear by columns and
the second by rows, so that one all-reduce in forward and one in backward are all it sends; by
hand, then with DTensor's `parallelize_module`. Pipeline parallelism splits the layers into
stages that pass micro-batches with send/recv, in GPipe's order and in 1F1B's. Every function
here runs on a rank (`%%ranks`) and returns plain records for the parent to print and plot;
`CollectiveLog` (the kit's ledger) counts collectives at torch's dispatch level, so any way
of calling them counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..checks import Case, case
from ..exercises import NotAttempted, exercise_check, require, solution_module
from ..ledger import Ledger

D, HIDDEN, BATCH = 16, 64, 8  # the MLP block: Linear(16, 64) -> GELU -> Linear(64, 16)
RTOL, ATOL = 1e-5, 1e-6  # float32 sums taken in another order: a few ulps apart at most
WIDTH, BLOCKS, PIPE_BATCH = 64, 6, 16  # the pipeline's model: 6 x (Linear(64, 64) + Tanh)
TIMED = {"width": 512, "batch": 128}  # for the timelines: compute well above a send's cost
MICROBATCHES = (1, 2, 4, 8)


# The kit's one record of collectives, under the name this lesson's cells use.
CollectiveLog = Ledger


# ---------------------------------------------------------------- tensor parallel by hand


def mlp_block(seed: int = 0, d: int = D, hidden: int = HIDDEN) -> nn.Sequential:
    """Linear(d, hidden) -> GELU -> Linear(hidden, d), a transformer's MLP; weights from seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


def block_input(seed: int = 1, batch: int = BATCH, d: int = D) -> tuple[torch.Tensor, ...]:
    """The block's input x and the gradient dy that flows back into its output (as if from a
    loss); both depend only on `seed`, so every rank makes the same."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)


class CopyToRanks(torch.autograd.Function):
    """Megatron's f: the identity in forward; in backward, the sum over the ranks of the
    gradient, since each rank's half of the block sends back only its part of dL/dx."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SumOverRanks(torch.autograd.Function):
    """Megatron's g: the sum over the ranks in forward; the identity in backward (each rank
    holds the whole output, so each already has the whole dL/dy)."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_ranks(x: torch.Tensor) -> torch.Tensor:
    """f: x unchanged; its gradient all-reduced in backward."""
    return CopyToRanks.apply(x)


def sum_over_ranks(partial: torch.Tensor) -> torch.Tensor:
    """g: the all-reduced sum of every rank's partial; the gradient passed through."""
    return SumOverRanks.apply(partial)


def unsplit(seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference: the whole block on one rank, its output and every gradient."""
    block = mlp_block(seed)
    x, dy = block_input()
    x.requires_grad_(True)
    y = block(x)
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, "w1": block[0].weight.grad, "b1": block[0].bias.grad,
            "w2": block[2].weight.grad, "b2": block[2].bias.grad}


def split_like_megatron(full: dict[str, torch.Tensor], rank: int,
                        world_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of each tensor of `unsplit()`: rows of W1 and b1 (the first layer's
    output features), columns of W2; x, y and b2 whole."""
    mine = dict(full)
    for key, dim in (("w1", 0), ("b1", 0), ("w2", 1)):
        mine[key] = full[key].chunk(world_size, dim=dim)[rank]
    return mine


def compare_with_unsplit(got: dict[str, torch.Tensor], rank: int, world_size: int,
                         seed: int = 0) -> str:
    """One line per tensor: is this rank's output or gradient (a DTensor: its local shard)
    equal to the unsplit block's share, within RTOL and ATOL?"""
    want = split_like_megatron(unsplit(seed), rank, world_size)
    lines = []
    for key, value in got.items():
        value = value.to_local() if hasattr(value, "to_local") else value
        ok = case(key, value, want[key], RTOL, ATOL).ok
        lines.append(f"{key}: equal within rtol={RTOL:g}, atol={ATOL:g}: {ok}")
    return "; ".join(lines)


@torch.no_grad()
def rows_first_forward(block: nn.Sequential, x: torch.Tensor, rank: int,
                       world_size: int) -> torch.Tensor:
    """The other split: W1 by rows of A = W1ᵀ (its input features), W2 by columns. GELU needs
    the whole pre-activation, so the first layer's partial sums are all-reduced before it, and
    the second layer leaves each rank a slice of the output, which must be all-gathered."""
    w1 = block[0].weight.tensor_split(world_size, dim=1)[rank]  # my input features of layer 1
    x_mine = x.tensor_split(world_size, dim=1)[rank]  # ... and the same columns of x (no message)
    pre = x_mine @ w1.T
    dist.all_reduce(pre)  # the whole (batch x hidden) pre-activation: 4x the output's bytes
    h = F.gelu(pre + block[0].bias)
    w2 = block[2].weight.tensor_split(world_size, dim=0)[rank]  # my output features of layer 2
    y_mine = h @ w2.T + block[2].bias.tensor_split(world_size)[rank]
    # all_gather wants equal shapes: pad to the widest share (16 features over 3: 6, 5, 5)
    widths = [len(t) for t in torch.arange(block[2].out_features).tensor_split(world_size)]
    pieces = [y_mine.new_empty(len(y_mine), widths[0]) for _ in range(world_size)]
    dist.all_gather(pieces, F.pad(y_mine, (0, widths[0] - y_mine.shape[1])))
    return torch.cat([piece[:, :w] for piece, w in zip(pieces, widths)], dim=1)


# ---------------------------------------------------------------- tensor parallel with DTensor


def parallel_block(device: torch.device, seed: int = 0) -> nn.Module:
    """The same block through DTensor: ColwiseParallel on the first Linear, RowwiseParallel on
    the second, on a one-dimensional mesh of every rank, the hidden activation kept a DTensor
    between them (the notebook's plan: it runs when the ranks do not divide the hidden width)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return parallelize_module(mlp_block(seed).to(device), mesh,
                              {"0": ColwiseParallel(use_local_output=False),
                               "2": RowwiseParallel(input_layouts=Shard(-1))})


def describe_parameter(p) -> str:
    """A DTensor parameter in one line: global shape, placements, this rank's local shape."""
    return (f"{type(p).__name__}: global {tuple(p.shape)}, placements {p.placements}, "
            f"local shard {tuple(p.to_local().shape)}")


# ---------------------------------------------------------------- attention split by heads

SEQ_BATCH, SEQ_LEN, SEQ_D, HEADS = 2, 6, 24, 6  # 6 positions and 6 heads: 2 or 3 ranks alike


class SelfAttention(nn.Module):
    """Multi-head self-attention without a mask: q, k, v and the output projection o are
    Linear(d, d); head j uses features j·d/heads to (j + 1)·d/heads of q, k and v."""

    def __init__(self, d: int = SEQ_D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(attend(self.q(x), self.k(x), self.v(x), self.heads))


def attention_layer(seed: int = 0) -> SelfAttention:
    """The attention layer, its weights from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return SelfAttention()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """softmax(q kᵀ / √head_dim) v for each of `heads` heads, side by side: (b, s, heads x
    head_dim) in and out. Each head reads only its own features of q, k and v, so a rank
    holding whole heads needs nothing from the others."""
    b, s, width = q.shape
    split = [t.reshape(b, s, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
    scores = split[0] @ split[1].transpose(-1, -2) / (width // heads) ** 0.5
    return (scores.softmax(-1) @ split[2]).transpose(1, 2).reshape(b, s, width)


def sequence_input(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A (batch, sequence, features) input and the gradient that flows back into the layer's
    output, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (SEQ_BATCH, SEQ_LEN, SEQ_D)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def compare_attention(got: dict[str, torch.Tensor], rank: int, world_size: int) -> str:
    """This rank's output and gradients against the unsplit layer's: q, k, v's weight rows and
    biases for its heads, o's weight columns for the same features, x, the output and o's
    bias whole."""
    layer = attention_layer(0)
    x, dy = sequence_input()
    x.requires_grad_(True)
    out = layer(x)
    out.backward(dy)
    want = {"out": out.detach(), "x": x.grad, "wo": layer.o.weight.grad.chunk(world_size, 1)[rank],
            "bo": layer.o.bias.grad}
    for name in "qkv":
        lin = getattr(layer, name)
        want[f"w{name}"] = lin.weight.grad.chunk(world_size, 0)[rank]
        want[f"b{name}"] = lin.bias.grad.chunk(world_size, 0)[rank]
    oks = [k for k, v in got.items() if case(k, v, want[k], RTOL, ATOL).ok]
    bad = [k for k in got if k not in oks]
    return (f"{', '.join(oks)} equal the unsplit layer's within rtol={RTOL:g}, atol={ATOL:g}"
            + (f"; NOT equal: {', '.join(bad)}" if bad else ""))


def _split_attention(layer: SelfAttention, x: torch.Tensor, rank: int, world_size: int):
    """The layer by heads, as the lesson's cell types it: f, my heads' q, k, v, g."""
    mine = [(lin.weight.chunk(world_size, 0)[rank], lin.bias.chunk(world_size, 0)[rank])
            for lin in (layer.q, layer.k, layer.v)]
    x = copy_to_ranks(x)
    q, k, v = (F.linear(x, w, b) for w, b in mine)
    ctx = attend(q, k, v, layer.heads // world_size)
    return sum_over_ranks(F.linear(ctx, layer.o.weight.chunk(world_size, 1)[rank])) + layer.o.bias


def _split_mlp(block: nn.Sequential, x: torch.Tensor, rank: int, world_size: int):
    """Megatron's MLP (section 1), on any leading dimensions."""
    w1, b1 = block[0].weight.chunk(world_size, 0)[rank], block[0].bias.chunk(world_size)[rank]
    h = F.gelu(F.linear(copy_to_ranks(x), w1, b1))
    return sum_over_ranks(F.linear(h, block[2].weight.chunk(world_size, 1)[rank])) + block[2].bias


def layer_collectives(rank: int, world_size: int, device: torch.device | None = None) -> str:
    """One transformer layer split like Megatron (attention by heads, then the MLP, each
    with its residual), forward and backward on (b, s, h) = (2, 6, 24): the collectives the
    Ledger records, against 2 all-reduces of b·s·h floats each way."""
    torch.manual_seed(0)
    attn = attention_layer(0).to(device)
    mlp = mlp_block(0, d=SEQ_D, hidden=4 * SEQ_D).to(device)
    x, dy = (t.to(device) for t in sequence_input())
    x.requires_grad_(True)
    with CollectiveLog() as fwd:
        h = x + _split_attention(attn, x, rank, world_size)
        y = h + _split_mlp(mlp, h, rank, world_size)
    with CollectiveLog() as bwd:
        y.backward(dy)
    bsh = SEQ_BATCH * SEQ_LEN * SEQ_D
    return (f"forward: {_calls(fwd.summary())}; backward: {_calls(bwd.summary())}; "
            f"2 x b·s·h = 2 x {SEQ_BATCH}·{SEQ_LEN}·{SEQ_D} floats = 2 x {4 * bsh:,} B each way")


def dropout_masks(outside: torch.Tensor, inside: torch.Tensor, shared: torch.Tensor) -> str:
    """Dropout masks across the ranks: `outside` on a replicated tensor (after g) must be the
    same on every rank; `inside` (on this rank's shard, a per-rank seed) and `shared` (the
    same, but every rank seeded alike) are compared too."""
    world_size = dist.get_world_size()

    def equal_everywhere(t: torch.Tensor) -> bool:
        everyone = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(everyone, t.contiguous())
        return all(torch.equal(e, everyone[0]) for e in everyone)

    return (f"the same mask on every rank? outside (replicated, one seed): "
            f"{equal_everywhere(outside == 0)}; inside (my shard, seed + 2718 + rank): "
            f"{equal_everywhere(inside == 0)}; inside with one seed for all: "
            f"{equal_everywhere(shared == 0)}")


# ---------------------------------------------------------------- the vocabulary split

VOCAB = 48  # the embedding's rows and the logits' columns: 24 per rank on 2 ranks, 16 on 3


class TinyLM(nn.Module):
    """A language model's two vocabulary-sized layers and nothing between them: the embedding
    (VOCAB rows of SEQ_D features) and the head, Linear(SEQ_D, VOCAB) without a bias, whose
    outputs are the logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, SEQ_D)
        self.head = nn.Linear(SEQ_D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


def vocab_model(seed: int = 0) -> TinyLM:
    """The embedding and the head, their weights from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return TinyLM()


def token_batch(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, sequence) = (2, 6) token ids and as many target ids in [0, VOCAB), the same on
    every rank; every rank's share of the vocabulary (2 or 3 ranks) holds some of each."""
    g = torch.Generator().manual_seed(seed)
    shape = (SEQ_BATCH, SEQ_LEN)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def vocab_range(rank: int, world_size: int) -> tuple[int, int]:
    """The rows [lo, hi) of the vocabulary rank `rank` owns."""
    return rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size


def _equal_line(got: dict, want: dict, whole: str) -> str:
    oks = [k for k, v in got.items() if case(k, _local(v), want[k], RTOL, ATOL).ok]
    bad = [k for k in got if k not in oks]
    return (f"{', '.join(oks)} equal {whole} within rtol={RTOL:g}, atol={ATOL:g}"
            + (f"; NOT equal: {', '.join(bad)}" if bad else ""))


def compare_vocab_embedding(got: dict[str, torch.Tensor], rank: int, world_size: int) -> str:
    """The split embedding's output (`e`, whole) and this rank's rows of the weight's
    gradient (`w_emb`) against nn.Embedding's on one rank, from the same dL/de."""
    model = vocab_model(0)
    tokens, _ = token_batch()
    e = model.emb(tokens)
    e.backward(sequence_input()[1])
    lo, hi = vocab_range(rank, world_size)
    return _equal_line(got, {"e": e.detach(), "w_emb": model.emb.weight.grad[lo:hi]},
                       "the unsplit embedding's")


def compare_vocab_loss(got: dict[str, torch.Tensor], rank: int, world_size: int) -> str:
    """The vocabulary-parallel loss, dL/dh and this rank's rows of the head's weight gradient
    against F.cross_entropy on the whole logits, on one rank."""
    model = vocab_model(0)
    _, targets = token_batch()
    h = sequence_input()[0].requires_grad_(True)
    loss = F.cross_entropy(model.head(h).flatten(0, 1), targets.flatten())
    loss.backward()
    lo, hi = vocab_range(rank, world_size)
    return _equal_line(got, {"loss": loss.detach(), "h": h.grad,
                             "w_head": model.head.weight.grad[lo:hi]},
                       "F.cross_entropy's on the whole logits")


def compare_loss_parallel(lm: nn.Module, loss, rank: int, world_size: int) -> str:
    """torch's version (RowwiseParallel embedding, ColwiseParallel head, loss_parallel): the
    loss, and both weights' gradients (the whole of each, summed from the DTensors), against
    the unsplit model's."""
    model = vocab_model(0)
    tokens, targets = token_batch()
    want = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    want.backward()
    got = {"loss": loss.full_tensor(), "emb grad": lm.emb.weight.grad.full_tensor(),
           "head grad": lm.head.weight.grad.full_tensor()}
    return _equal_line(got, {"loss": want.detach(), "emb grad": model.emb.weight.grad,
                             "head grad": model.head.weight.grad}, "the unsplit model's")


# ---------------------------------------------------------------- sequence parallelism


def norm_mlp_block(seed: int = 0) -> nn.Sequential:
    """LayerNorm(d) -> Linear(d, 4d) -> GELU -> Linear(4d, d): the MLP half of a transformer
    layer, with the norm that tensor parallelism leaves whole on every rank (d = 24)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(SEQ_D), nn.Linear(SEQ_D, 4 * SEQ_D), nn.GELU(),
                         nn.Linear(4 * SEQ_D, SEQ_D))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def compare_sequence_parallel(block: nn.Module, x_shard: torch.Tensor, y: torch.Tensor,
                              whole_norm_grad: torch.Tensor, rank: int,
                              world_size: int) -> str:
    """This rank's positions of the output and of dL/dx, its shards of the Linears' weight
    gradients, and the LayerNorm's weight gradient (its local part, and the whole one that
    full_tensor() summed), against the unsplit block on the whole sequence."""
    ref = norm_mlp_block(0)
    x, dy = sequence_input()
    x.requires_grad_(True)
    out = ref(x)
    out.backward(dy)
    mine = lambda t: t.tensor_split(world_size, dim=1)[rank]  # noqa: E731 - my positions
    pairs = {"y (my positions)": (_local(y), mine(out.detach())),
             "dL/dx (my positions)": (x_shard.grad, mine(x.grad)),
             "w1 (my rows)": (_local(block[1].weight.grad),
                              ref[1].weight.grad.chunk(world_size, 0)[rank]),
             "w2 (my columns)": (_local(block[3].weight.grad),
                                 ref[3].weight.grad.chunk(world_size, 1)[rank]),
             "LayerNorm weight, local": (_local(block[0].weight.grad), ref[0].weight.grad),
             "LayerNorm weight, full_tensor()": (whole_norm_grad, ref[0].weight.grad)}
    return "; ".join(f"{k}: {case(k, a, b, RTOL, 1e-5).ok}" for k, (a, b) in pairs.items())


def sp_memory(rank: int, world_size: int, device: torch.device | None = None) -> dict:
    """Activation bytes saved for backward by norm_mlp_block on this rank: unsplit, with TP
    alone (ColwiseParallel, RowwiseParallel) and with TP + SequenceParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(torch.device(device or "cpu").type, (world_size,))
    x, _ = (t.to(device) for t in sequence_input())
    plans = {"unsplit": None,
             "TP": {"1": ColwiseParallel(), "3": RowwiseParallel()},
             "TP + SP": {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                         "3": RowwiseParallel(output_layouts=Shard(1))}}
    out = {}
    for name, plan in plans.items():
        block = norm_mlp_block(0).to(device)
        if plan:
            block = parallelize_module(block, mesh, plan)
        inp = x.tensor_split(world_size, dim=1)[rank] if name == "TP + SP" else x
        with SavedActivations(block.parameters()) as saved:
            block(inp.clone().requires_grad_(True))
        out[name] = saved.peak
    return out


def sp_formulas(world_size: int) -> dict[str, int]:
    """fp32 bytes saved for backward, (b, s, h) = (2, 6, 24), 4h hidden, N ranks. LayerNorm
    keeps its input (b·s·h) and a mean and a 1/std per position (2·b·s); the first Linear its
    input (b·s·h); GELU and the second Linear the hidden activations (2 x b·s·4h/N with TP).
    Sequence parallelism divides the LayerNorm's by N; DTensor's first Linear keeps the
    all-gathered input, whole."""
    n, bs, h = world_size, SEQ_BATCH * SEQ_LEN, SEQ_D
    hidden = 2 * bs * 4 * h
    return {"unsplit": 4 * (2 * bs * h + 2 * bs + hidden),
            "TP": 4 * (2 * bs * h + 2 * bs + hidden // n),
            "TP + SP": 4 * (bs * h // n + 2 * bs // n + bs * h + hidden // n)}


def describe_sp_memory(measured: list[dict], world_size: int) -> str:
    """The activation bytes per rank, measured on every rank, against sp_formulas."""
    want = sp_formulas(world_size)
    lines = [f"activations saved for backward, LayerNorm + MLP, (b, s, h) = ({SEQ_BATCH}, "
             f"{SEQ_LEN}, {SEQ_D}), {world_size} ranks: bytes per rank [formula]"]
    for name, formula in want.items():
        got = {m[name] for m in measured}
        value = f"{got.pop():,}" if len(got) == 1 else f"differs by rank: {sorted(got)}"
        lines.append(f"  {name:<8} {value:>7} [{formula:,}]")
    return "\n".join(lines)


# ---------------------------------------------------------------- memory


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard only)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in module.parameters())


class SavedActivations:
    """Count the bytes autograd saves for backward, while they are held: the live total and its
    peak. Parameters saved (a Linear keeps its weight) are not activations and are skipped; a
    storage saved twice (one layer's output is the next one's input) counts once."""

    def __init__(self, params=()):
        self._skip = {_storage(p) for p in params}
        self._held: dict[tuple, list] = {}  # storage -> [bytes, references]
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor):
        key = _storage(t)
        if key in self._skip:
            return t
        local = getattr(t, "_local_tensor", t)
        entry = self._held.setdefault(key, [local.numel() * local.element_size(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return _Held(t, self, key)

    def _release(self, key: tuple) -> None:
        entry = self._held[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._held[key]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda h: h.tensor if isinstance(h, _Held) else h)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor; when autograd frees it (after its backward), the count drops."""

    def __init__(self, tensor, counter: SavedActivations, key: tuple):
        self.tensor, self._counter, self._key = tensor, counter, key

    def __del__(self):
        self._counter._release(self._key)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Where a saved tensor's data starts and how many elements: a layer's output saved again
    as the next layer's input is the same; two slices of one batch are not."""
    local = getattr(t, "_local_tensor", t)
    return local.data_ptr(), local.numel()


def tp_memory(rank: int, world_size: int, device: torch.device) -> dict[str, dict[str, int]]:
    """Parameter bytes and the activation bytes saved for backward, for the unsplit block, the
    hand-split one and DTensor's, on this rank (batch BATCH)."""
    x, dy = (t.to(device) for t in block_input())
    out = {}
    block = mlp_block(0).to(device)
    with SavedActivations(block.parameters()) as saved:
        y = block(x.requires_grad_(True))
    out["unsplit"] = {"parameters": param_bytes(block), "activations": saved.peak}
    y.backward(dy)
    w1, b1 = (t.chunk(world_size)[rank].clone().requires_grad_() for t in
              (block[0].weight.detach(), block[0].bias.detach()))
    w2 = block[2].weight.detach().chunk(world_size, dim=1)[rank].clone().requires_grad_()
    b2 = block[2].bias.detach().clone().requires_grad_()
    with SavedActivations([w1, b1, w2, b2]) as saved:
        h = F.gelu(F.linear(copy_to_ranks(x), w1, b1))
        y = sum_over_ranks(F.linear(h, w2)) + b2
    out["by hand"] = {"parameters": sum(t.numel() * 4 for t in (w1, b1, w2, b2)),
                      "activations": saved.peak}
    y.backward(dy)
    tp_block = parallel_block(device)
    with SavedActivations(tp_block.parameters()) as saved:
        y = tp_block(x)
    out["DTensor"] = {"parameters": param_bytes(tp_block), "activations": saved.peak}
    return out


def hidden_share(world_size: int, rank: int = 0, hidden: int = HIDDEN) -> int:
    """How many hidden features `rank` holds: torch.chunk's split (64 over 3: 22, 22, 20)."""
    return len(torch.arange(hidden).chunk(world_size)[rank])


def tp_formulas(world_size: int, batch: int = BATCH, d: int = D,
                hidden: int = HIDDEN, rank: int = 0) -> dict[str, dict[str, int]]:
    """fp32 bytes: parameters 2·d·h + h + d unsplit, 2·d·h_r + h_r + d on a rank holding h_r
    hidden features (h/N when N divides h; b2 whole); activations x (b·d, on every rank), the
    pre-activation and the GELU's output (b·h each unsplit, b·h_r on the rank)."""
    share = hidden_share(world_size, rank, hidden)
    return {"unsplit": {"parameters": 4 * (2 * d * hidden + hidden + d),
                        "activations": 4 * (batch * d + 2 * batch * hidden)},
            "split": {"parameters": 4 * (2 * d * share + share + d),
                      "activations": 4 * (batch * d + 2 * batch * share)}}


# ---------------------------------------------------------------- pipeline parallel


def pipeline_model(seed: int = 0, width: int = WIDTH, blocks: int = BLOCKS) -> nn.Sequential:
    """`blocks` x (Linear(width, width) + Tanh): a model to cut into consecutive stages."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(blocks)])


def stage_of(model: nn.Sequential, stage: int, num_stages: int) -> nn.Sequential:
    """Stage `stage`'s consecutive blocks (6 blocks: 3 + 3 on two stages, 2 + 2 + 2 on three)."""
    index = torch.arange(len(model)).tensor_split(num_stages)[stage]
    return nn.Sequential(*[model[int(i)] for i in index])


def pipeline_batch(batch: int = PIPE_BATCH, width: int = WIDTH) -> tuple[torch.Tensor, ...]:
    """The step's whole batch and its targets (every rank can make them: a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def loss_of(out: torch.Tensor, target: torch.Tensor, batch: int) -> torch.Tensor:
    """Squared error summed over features, averaged over the whole batch: a micro-batch's share
    of the batch's loss, so that the micro-batches' gradients add up to the batch's."""
    return ((out - target) ** 2).sum() / batch


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """GPipe's order on every stage: every forward, then every backward."""
    return ([("F", i) for i in range(num_microbatches)] +
            [("B", i) for i in range(num_microbatches)])


def simulate(orders: list[list[tuple[str, int]]]) -> list[list[tuple[str, int, int]]]:
    """Each stage's ops with the slot each starts in, if every forward and every backward takes
    one slot: an op starts once the stage is free and its input has arrived (a forward needs the
    previous stage's forward of that micro-batch, a backward the next stage's backward). Raises
    ValueError, naming the stage and op, if the orders are not a valid schedule or deadlock."""
    p = len(orders)
    for s, order in enumerate(orders):
        _check_order(order, s)
    end: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> slot it ends in
    nxt, free = [0] * p, [0] * p
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                needs += [("B", s + 1, i)] if kind == "B" and s < p - 1 else []
                needs += [("F", s, i)] if kind == "B" else []
                if any(n not in end for n in needs):
                    break
                start = max([free[s]] + [end[n] for n in needs])
                out[s].append((kind, i, start))
                end[(kind, s, i)] = free[s] = start + 1
                nxt[s] += 1
                moved = True
        if not moved:
            waits = [f"stage {s} at {orders[s][nxt[s]]}" for s in range(p)
                     if nxt[s] < len(orders[s])]
            raise ValueError(f"the orders deadlock: {', '.join(waits)} each wait for another")
    return out


def _check_order(order, stage: int) -> None:
    if not isinstance(order, (list, tuple)):
        raise ValueError(f"stage {stage}: the order is {type(order).__name__}, expected a list "
                         "of ('F', i) and ('B', i)")
    seen = set()
    for op in order:
        if (not isinstance(op, (list, tuple)) or len(op) != 2 or op[0] not in ("F", "B")
                or tuple(op) in seen):
            raise ValueError(f"stage {stage}: {op!r} is not a new ('F', i) or ('B', i)")
        if op[0] == "B" and ("F", op[1]) not in seen:
            raise ValueError(f"stage {stage}: ('B', {op[1]}) comes before ('F', {op[1]})")
        seen.add(tuple(op))
    fwd = sorted(i for k, i in seen if k == "F")
    if sorted(i for k, i in seen if k == "B") != fwd or fwd != list(range(len(fwd))):
        raise ValueError(f"stage {stage}: every micro-batch 0..m-1 needs one F and one B")


def bubble_from_slots(slots: list[list[tuple[str, int, int]]]) -> float:
    """The idle fraction of the pipeline's span, over all stages: 1 - busy slots / (p x span)."""
    span = max(start + 1 for ops in slots for _, _, start in ops)
    busy = sum(len(ops) for ops in slots)
    return 1 - busy / (len(slots) * span)


def peak_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and backward has not, at any point: each one's
    activations are held until its backward."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _order_function(name: str, namespace: dict | None) -> tuple[Callable, str]:
    """gpipe, or 1F1B from the learner's one_f_one_b where written, else the kit's solution."""
    if name == "gpipe":
        return gpipe, "GPipe"
    try:
        return require(namespace or {}, "one_f_one_b"), "1F1B (yours)"
    except NotAttempted:
        return solution_module("one_f_one_b").one_f_one_b, "1F1B (the kit's solution)"


def run_stage(stage: nn.Module, order: list[tuple[str, int]], rank: int, world_size: int,
              inputs: list[torch.Tensor], targets: list[torch.Tensor], batch: int) -> list:
    """Run this rank's stage over the micro-batches in `order`: a forward needs its input from
    the previous rank (the first stage reads `inputs`) and sends its output on; a backward needs
    the gradient of that output from the next rank (the last stage starts from the loss) and
    sends its input's gradient back. Each op's sends go out in one
    `batch_isend_irecv` with the receives the next op needs, and the whole batch is waited on:
    on NCCL, sends and receives that must progress together are posted as one group. Returns
    what ran, with times: [(kind, micro-batch, start s, end s)]."""
    first, last = rank == 0, rank == world_size - 1
    held, ran, sends = {}, [], []
    for kind, i in order:
        recvs, buffer = [], None
        if kind == "F" and not first:
            buffer = torch.empty_like(inputs[i])  # an activation: the input's shape
            recvs = [dist.P2POp(dist.irecv, buffer, rank - 1)]
        elif kind == "B" and not last:
            buffer = torch.empty_like(held[i][1])  # the gradient of my output
            recvs = [dist.P2POp(dist.irecv, buffer, rank + 1)]
        _exchange(sends + recvs)  # the last op's sends with this op's receive, waited on
        sends = []
        if kind == "F":
            x = inputs[i] if first else buffer.requires_grad_(True)
            start = _now(x)
            out = stage(x)
            if last:
                out = loss_of(out, targets[i], batch)
            ran.append(("F", i, start, _now(out)))
            if not last:
                sends = [dist.P2POp(dist.isend, out.detach(), rank + 1)]
            held[i] = (x, out)
        else:
            x, out = held.pop(i)
            start = _now(out)
            out.backward(buffer)
            ran.append(("B", i, start, _now(out)))
            if not first:
                sends = [dist.P2POp(dist.isend, x.grad, rank - 1)]
    _exchange(sends)
    return ran


def _exchange(ops: list) -> None:
    """Post sends and receives as one batch and wait for all of them (gloo returns one Work per
    op, NCCL one for the batch; waiting on each covers both)."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _now(t: torch.Tensor) -> float:
    """perf_counter once the device has finished what was queued (a GPU runs asynchronously)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return time.perf_counter()


def run_pipeline(schedule: str, num_microbatches: int, rank: int, world_size: int,
                 namespace: dict | None = None, timed: bool = False,
                 device: torch.device | None = None) -> dict:
    """One training step of the pipeline model on `world_size` stages, in "gpipe" or "1f1b"
    order: what ran and when, the collectives, the peak activation bytes held, and whether this
    stage's gradients equal the unsplit model's on the same batch."""
    kw = {"width": TIMED["width"]} if timed else {}
    batch = TIMED["batch"] if timed else PIPE_BATCH
    order_of, source = _order_function(schedule, namespace)
    orders = [_as_order(order_of(s, world_size, num_microbatches)) for s in range(world_size)]
    simulate(orders)  # refuses, on every rank alike, orders that are invalid or would deadlock
    model = pipeline_model(0, **kw)
    stage = stage_of(model, rank, world_size).to(device)
    x, target = pipeline_batch(batch, **kw)
    inputs, targets = (t.to(device).tensor_split(num_microbatches) for t in (x, target))
    log = CollectiveLog()
    # Start together: a rank still building its model would otherwise show as bubble on its
    # neighbours' clocks (outside the log, so the counts are the schedule's alone).
    dist.barrier()
    with SavedActivations(stage.parameters()) as saved, log:
        ran = run_stage(stage, orders[rank], rank, world_size, inputs, targets, batch)
    mine = [p.grad for p in stage.parameters()]
    want = _unsplit_stage_grads(rank, world_size, batch, **kw)
    return {"schedule": source, "m": num_microbatches, "ran": ran,
            "order": [(k, i) for k, i, _, _ in ran], "collectives": log.summary(),
            "calls": list(log.calls),
            "peak_activations": saved.peak, "parameters": param_bytes(stage),
            "grads_equal": case("gradients", _flat(mine), _flat(want), RTOL, ATOL).ok}


def compare_stage_grads(stage: nn.Module, rank: int, world_size: int) -> str:
    """Are this stage's accumulated gradients (a step over micro-batches of pipeline_batch())
    the unsplit model's for the whole batch, its blocks' share, within RTOL and ATOL?"""
    want = _flat(_unsplit_stage_grads(rank, world_size, PIPE_BATCH))
    mine = _flat(p.grad.cpu() for p in stage.parameters())
    ok = case("gradients", mine, want, RTOL, ATOL).ok
    return (f"my stage's gradients, summed over the micro-batches, equal the unsplit model's "
            f"on the whole batch within rtol={RTOL:g}, atol={ATOL:g}: {ok}")


def _unsplit_stage_grads(rank: int, world_size: int, batch: int, **kw) -> list[torch.Tensor]:
    """The gradients of stage `rank`'s blocks when the unsplit model takes the whole batch:
    what a pipeline step over micro-batches must add up to."""
    whole = pipeline_model(0, **kw)
    x, target = pipeline_batch(batch, **kw)
    loss_of(whole(x), target, batch).backward()
    return [p.grad for p in stage_of(whole, rank, world_size).parameters()]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def schedule_runs(rank: int, world_size: int, namespace: dict | None = None,
                  microbatches: tuple[int, ...] = MICROBATCHES, timed: bool = True,
                  device: torch.device | None = None) -> list:
    """run_pipeline for GPipe and 1F1B at each micro-batch count (the timed, wider model)."""
    return [run_pipeline(s, m, rank, world_size, namespace, timed, device)
            for s in ("gpipe", "1f1b") for m in microbatches]


def slots_of(per_rank: list[dict]) -> list[list[tuple[str, int, int]]]:
    """The slot each op started in, from the order each rank actually ran them in."""
    return simulate([r["order"] for r in per_rank])


def wall_bubble(per_rank: list[dict]) -> float:
    """The idle fraction measured in wall time: 1 - compute time / (ranks x the step's span
    from the first forward's start to the last backward's end), one machine's clock."""
    start = min(t for r in per_rank for _, _, t, _ in r["ran"])
    end = max(t for r in per_rank for _, _, _, t in r["ran"])
    busy = sum(b - a for r in per_rank for _, _, a, b in r["ran"])
    return 1 - busy / (len(per_rank) * (end - start))


def by_run(runs: list[list[dict]]) -> list[list[dict]]:
    """Per-rank lists of runs (what --return brings) as per-run lists of ranks."""
    return [list(ranks) for ranks in zip(*runs)]


def describe_runs(runs: list[list[dict]]) -> str:
    """Per schedule and micro-batch count: gradients against the unsplit model on every rank,
    what rank 0 sent and received, its peak in flight, and the bubble counted in slots."""
    lines = [f"{'schedule':<28}{'m':>3}  grads equal  rank 0 sent / received"
             "          in flight (rank 0)  bubble in slots"]
    for per_rank in by_run(runs):
        first = per_rank[0]
        sent = first["collectives"].get("send", (0, 0))
        got = first["collectives"].get("recv", (0, 0))
        ok = "yes" if all(r["grads_equal"] for r in per_rank) else "NO"
        lines.append(f"{first['schedule']:<28}{first['m']:>3}  {ok:<11}  "
                     f"{sent[0]:>2} x send, {got[0]:>2} x recv, {sent[1] + got[1]:>9,} B  "
                     f"{peak_in_flight(first['order']):>9}           "
                     f"{bubble_from_slots(slots_of(per_rank)):.3f}")
    return "\n".join(lines)


def describe_wall_bubble(runs: list[list[dict]]) -> str:
    """The bubble in wall time beside the one in slots (not reproducible: a measurement)."""
    lines = [f"{'schedule':<28}{'m':>3}  in slots  in wall time"]
    for per_rank in by_run(runs):
        lines.append(f"{per_rank[0]['schedule']:<28}{per_rank[0]['m']:>3}  "
                     f"{bubble_from_slots(slots_of(per_rank)):>8.3f}  "
                     f"{wall_bubble(per_rank):>12.3f}")
    ratios = []
    for rank in range(len(runs)):
        ops = [op for per_rank in by_run(runs) for op in per_rank[rank]["ran"]]
        f, b = ([t1 - t0 for k, _, t0, t1 in ops if k == kind] for kind in "FB")
        ratios.append(f"rank {rank} {statistics.median(b) / statistics.median(f):.1f}")
    lines.append("a backward's time over a forward's (medians over every run): "
                 + ", ".join(ratios))
    return "\n".join(lines)


def describe_ran(runs: list[list[dict]]) -> str:
    """What is deterministic about the timed runs: each rank ran one forward and one backward
    of every micro-batch, and its gradients equal the unsplit model's."""
    ok = all(sorted(r["order"]) == sorted(gpipe(0, 1, r["m"])) and r["grads_equal"]
             for per_rank in by_run(runs) for r in per_rank)
    return (f"{len(by_run(runs))} timed runs on {len(runs)} ranks; every rank ran one forward "
            f"and one backward of each micro-batch, with the unsplit model's gradients: "
            f"{'yes' if ok else 'NO'}")


def predicted_bubbles(fn: Callable | None, runs: list[list[dict]]) -> str:
    """The learner's bubble_fraction(p, m) beside the bubble counted in slots, if written."""
    try:
        fn = require({"bubble_fraction": fn}, "bubble_fraction")
    except NotAttempted:
        return ("no prediction yet: write bubble_fraction's body (section 3's exercise), run "
                "its cell, then rerun this cell to see it beside the bubble counted in slots")
    lines = []
    for per_rank in by_run(runs):
        p, m = len(per_rank), per_rank[0]["m"]
        lines.append(f"{per_rank[0]['schedule']:<28} p={p} m={m}: counted "
                     f"{bubble_from_slots(slots_of(per_rank)):.3f}, yours {float(fn(p, m)):.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- interleaved 1F1B, in slots


def interleaved_order(rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Rank `rank`'s order in Megatron-LM's interleaved 1F1B, with v model chunks per rank
    (chunk c of rank r is stage c·p + r of p·v) and m micro-batches, a multiple of p: forwards
    go through the chunks in groups of p micro-batches (chunk 0 for micro-batches 0..p-1, then
    chunk 1 for the same, ...), backwards the same with the chunks reversed; a warm-up of
    (p - r - 1)·2 + (v - 1)·p forwards, then one forward and one backward, then the backwards
    left. [(kind, chunk, micro-batch)]."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m a multiple of p: m={m}, p={p}")
    total = m * v

    def op(kind: str, k: int) -> tuple[str, int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        return kind, chunk, group * p + within % p

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def simulate_interleaved(p: int, v: int, m: int) -> list[list[tuple[str, int, int, int]]]:
    """Each rank's ops in interleaved 1F1B with the slot each starts in, every forward and
    every backward of one chunk taking one slot (a chunk is 1/v of the rank's layers): an op
    starts once its rank is free and its input has arrived (a forward needs the previous
    stage's forward of that micro-batch, a backward the next stage's backward and its own
    forward). Raises ValueError if the orders deadlock."""
    orders = [interleaved_order(r, p, v, m) for r in range(p)]
    last = p * v - 1
    end: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> slot it ends in
    nxt, free = [0] * p, [0] * p
    out: list[list[tuple[str, int, int, int]]] = [[] for _ in range(p)]
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, chunk, i = orders[r][nxt[r]]
                s = chunk * p + r
                if kind == "F":
                    needs = [("F", s - 1, i)] if s > 0 else []
                else:
                    needs = [("F", s, i)] + ([("B", s + 1, i)] if s < last else [])
                if any(n not in end for n in needs):
                    break
                start = max([free[r]] + [end[n] for n in needs])
                out[r].append((kind, chunk, i, start))
                end[(kind, s, i)] = free[r] = start + 1
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError("the interleaved orders deadlock")
    return out


def interleaved_counts(p: int, v: int, m: int) -> dict:
    """From the slot simulation: the bubble over the ideal time (idle slots per rank over its
    2·m·v busy ones) beside (p - 1)/(v·m), and the activations and gradients sent per step,
    counted from the ops (a forward sends unless on the last stage, a backward unless on the
    first: 2·m·(p·v - 1), against 2·m·(p - 1) without interleaving)."""
    slots = simulate_interleaved(p, v, m)
    span = max(start + 1 for ops in slots for *_, start in ops)
    busy = 2 * m * v
    sends = sum(1 for r, ops in enumerate(slots) for kind, chunk, _, _ in ops
                if (kind == "F" and chunk * p + r < p * v - 1) or (kind == "B" and chunk * p + r))
    return {"p": p, "v": v, "m": m, "bubble": (span - busy) / busy,
            "formula": (p - 1) / (v * m), "sends": sends}


def describe_interleaved(p: int = 2, v: int = 2, m: int = 4,
                         cases: tuple = ((2, 1, 4), (2, 2, 4), (4, 1, 8), (4, 2, 8),
                                         (4, 4, 8))) -> str:
    """Interleaved 1F1B in slots: one row per rank for (p, v, m), each op as its kind (F or B),
    micro-batch and chunk (a, b, ...), "..." where the rank is idle; then, for each case, the
    bubble over the ideal time counted against (p - 1)/(v·m), and the sends per step."""
    slots = simulate_interleaved(p, v, m)
    span = max(start + 1 for ops in slots for *_, start in ops)
    lines = [f"interleaved 1F1B, p={p} ranks, v={v} chunks each, m={m} micro-batches; one "
             "slot is one chunk's forward or backward"]
    for r, ops in enumerate(slots):
        row = ["..."] * span
        for kind, chunk, i, start in ops:
            row[start] = f"{kind}{i}{'abcdefgh'[chunk]}"
        lines.append(f"  rank {r}: " + " ".join(row))
    lines.append(f"{'p':>3}{'v':>3}{'m':>3}  bubble / ideal (counted)  (p-1)/(v·m)  sends per step")
    for cp, cv, cm in cases:
        c = interleaved_counts(cp, cv, cm)
        lines.append(f"{cp:>3}{cv:>3}{cm:>3}  {c['bubble']:>24.4f}  {c['formula']:>11.4f}  "
                     f"{c['sends']:>14}")
    return "\n".join(lines)

# ---------------------------------------------------------------- memory of the pipeline


def pp_formulas(world_size: int, num_microbatches: int, width: int = WIDTH,
                blocks: int = BLOCKS, batch: int = PIPE_BATCH) -> list[dict[str, dict]]:
    """fp32 bytes per stage: parameters, the stage's share of the blocks; activations saved for
    one micro-batch of b = batch/m samples, the stage's input and each block's output (b·W
    each; the last stage's loss keeps one more), times the micro-batches in flight: m for GPipe,
    min(p - s, m) for 1F1B."""
    per_block = 4 * (width * width + width)
    sizes = [len(t) for t in torch.arange(blocks).tensor_split(world_size)]
    b = batch // num_microbatches
    out = []
    for s, n in enumerate(sizes):
        one = 4 * b * width * (n + 1 + (s == world_size - 1))
        out.append({"parameters": n * per_block,
                    "gpipe": num_microbatches * one,
                    "1f1b": min(world_size - s, num_microbatches) * one})
    return out


def unsplit_pipeline_memory(width: int = WIDTH, blocks: int = BLOCKS,
                            batch: int = PIPE_BATCH) -> dict[str, int]:
    """The whole model on one rank, one batch: its parameters and the activations it saves."""
    model = pipeline_model(0, width, blocks)
    x, target = pipeline_batch(batch, width)
    with SavedActivations(model.parameters()) as saved:
        loss = loss_of(model(x), target, batch)
    loss.backward()
    return {"parameters": param_bytes(model), "activations": saved.peak}


def describe_memory(tp: list[dict], pp: list[list[dict]], world_size: int) -> str:
    """KiB per rank for TP (unsplit, by hand, DTensor) and PP (GPipe, 1F1B, the small model
    with m = 4), measured, with the formula in brackets."""
    kib = lambda n: f"{n / 1024:.2f}"  # noqa: E731
    tpf = tp_formulas(world_size)
    lines = [f"tensor parallel, the MLP block, batch {BATCH}, {world_size} ranks: KiB per rank "
             "(formula in brackets)"]
    shares = [hidden_share(world_size, r) for r in range(world_size)]
    for kind, mem in tp[0].items():
        key = "unsplit" if kind == "unsplit" else "split"
        want = tpf[key]
        same = all(r[kind] == mem for r in tp)
        if same or kind == "unsplit":
            note = f"every rank the same: {'yes' if same else 'NO'}"
        else:  # an uneven split: each rank against its own share's formula
            own = all(r[kind] == tp_formulas(world_size, rank=i)[key] for i, r in enumerate(tp))
            note = (f"rank 0's; the shares are {', '.join(map(str, shares))} hidden features, "
                    f"each rank at its share's formula: {'yes' if own else 'NO'}")
        lines.append(f"  {kind:<9} parameters {kib(mem['parameters'])} [{kib(want['parameters'])}]"
                     f"  activations {kib(mem['activations'])} [{kib(want['activations'])}]"
                     f"  ({note})")
    whole = unsplit_pipeline_memory()
    runs = {r[0]["schedule"].split(" ")[0]: r for r in by_run(pp)}
    m = next(iter(runs.values()))[0]["m"]
    ppf = pp_formulas(world_size, m)
    lines.append(f"pipeline parallel, {BLOCKS} blocks of width {WIDTH}, batch {PIPE_BATCH}, "
                 f"m = {m}: KiB per rank (formula in brackets)")
    lines.append(f"  unsplit   parameters {kib(whole['parameters'])}  activations "
                 f"{kib(whole['activations'])}")
    for s in range(world_size):
        g, f = runs["GPipe"][s], runs["1F1B"][s]
        lines.append(f"  stage {s}   parameters {kib(g['parameters'])} "
                     f"[{kib(ppf[s]['parameters'])}]"
                     f"  activations GPipe {kib(g['peak_activations'])} [{kib(ppf[s]['gpipe'])}]"
                     f", 1F1B {kib(f['peak_activations'])} [{kib(ppf[s]['1f1b'])}]")
    return "\n".join(lines)


def memory_runs(rank: int, world_size: int, namespace: dict | None = None,
                num_microbatches: int = 4, device: torch.device | None = None) -> list[dict]:
    """GPipe and 1F1B on the small model, for their peak activations."""
    return [run_pipeline(s, num_microbatches, rank, world_size, namespace, device=device)
            for s in ("gpipe", "1f1b")]


# ---------------------------------------------------------------- torch.distributed.pipelining


RECV_LATE_S = 1.0  # how late rank 1 posts its recv in send_waits_for_recv


def send_waits_for_recv(rank: int, device: torch.device | None = None) -> str:
    """Rank 0 makes a blocking send of one float to rank 1, which posts its recv RECV_LATE_S
    after the barrier both leave together. On gloo the send returns only once that recv is
    posted (gloo's tcp Pair::send holds the data until the peer says it is ready to receive), so
    it takes at least about that long: two ranks that both send first would deadlock. A verdict
    against a threshold, not the time itself, so that a loaded machine cannot change it (a late
    peer only makes the send longer)."""
    dist.barrier()
    if rank == 0:
        start = time.perf_counter()
        dist.send(torch.ones(1, device=device), dst=1)
        took = time.perf_counter() - start
        return (f"my blocking send of 4 bytes returned only after rank 1 posted its recv "
                f"{RECV_LATE_S:g} s late: {took >= 0.9 * RECV_LATE_S}")
    if rank != 1:  # a third rank only keeps the barrier company
        return "not in this exchange"
    time.sleep(RECV_LATE_S)
    dist.recv(torch.empty(1, device=device), src=0)
    return f"posted my recv {RECV_LATE_S:g} s after the barrier"


def pipelining_status() -> str:
    """"runs" if this torch's torch.distributed.pipelining can run on gloo without the known
    hang; else why not. Before pytorch#152938 (2025), its schedules waited on one Work of
    batch_isend_irecv's list, which holds one Work per op on gloo (one in all on NCCL), so a
    rank could go on before its sends and receives were done and hang (pytorch#132644); the fix
    added `_wait_batch_p2p`, which waits on every one, and that is what is checked for."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return "this torch has no torch.distributed.pipelining"
    if not hasattr(schedules, "_wait_batch_p2p"):
        return ("this torch's pipelining waits on one Work of several on gloo and can hang "
                "(pytorch#132644): not run here")
    # A bug, not an API, so no feature to ask for: on torch 2.9.1 the schedules' first step
    # begins with a handshake between neighbouring stages (stage.py, _get_init_p2p_neighbors_ops)
    # that receives into torch.zeros(1), float32, 4 bytes, what the neighbour sends as
    # torch.tensor(stage_index), int64, 8 bytes; gloo checks the sizes and aborts the rank
    # ("8 vs 4"). torch 2.14.1 receives a float32 from a float32. Releases in between were not
    # checked, so they are not run.
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 14):
        return (f"not run on torch {torch.__version__.split('+')[0]}: its schedules' first "
                "step sends an int64 stage index (8 B) where the neighbour receives into a "
                "float32[1] (4 B), and gloo aborts the rank (torch/distributed/pipelining/"
                "stage.py, _get_init_p2p_neighbors_ops); the kit runs them from torch 2.14, "
                "whose first step warms up with an int32 vote instead (schedules.py, "
                "_warmup_p2p)")
    return "runs"


def traced_stages(split_at: int = BLOCKS // 2, num_microbatches: int = 4) -> str:
    """torch's `pipeline()` tracer on the pipeline model, cut at block `split_at`
    (SplitPoint.BEGINNING): each stage's parameters, or why this torch cannot trace it (torch
    2.9.1's export unflattener fails on this model). One process, no group: tracing runs
    torch.export on one micro-batch, before any rank exists."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    x, _ = pipeline_batch()
    micro = x.tensor_split(num_microbatches)[0]
    model = pipeline_model(0)
    try:
        pipe = pipeline(model, mb_args=(micro,), split_spec={str(split_at): SplitPoint.BEGINNING})
    except RuntimeError as e:  # asked of torch itself, not of its version number
        return (f"not run on torch {torch.__version__.split('+')[0]}: its pipeline() tracer "
                f"fails on this model (torch/export/unflatten.py: "
                f"{(str(e).splitlines() or [''])[0][:90]}...); torch 2.14 traces it")
    lines = [f"pipeline() cut the model into {pipe.num_stages} stages:"]
    for i in range(pipe.num_stages):
        names = [n for n, _ in pipe.get_stage_module(i).named_parameters()]
        lines.append(f"  stage {i}: {len(names)} tensors, {names[0]} ... {names[-1]}")
    with torch.no_grad():
        same = torch.allclose(pipe.get_stage_module(0)(micro), stage_of(model, 0, 2)(micro),
                              rtol=RTOL, atol=ATOL)
    lines.append(f"stage 0's output equals stage_of(model, 0, 2)'s on a micro-batch "
                 f"(rtol={RTOL:g}, atol={ATOL:g}): {same}")
    return "\n".join(lines)


def torch_gpipe(rank: int, world_size: int, device: torch.device,
                num_microbatches: int = 4) -> dict:
    """One step of the same pipeline with torch.distributed.pipelining's ScheduleGPipe: the
    collectives it issued, and whether this stage's gradients equal the unsplit model's."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_module = stage_of(pipeline_model(0), rank, world_size).to(device)
    stage = PipelineStage(stage_module, rank, world_size, device)
    # pipelining averages the micro-batches' gradients (scale_grads=True): a micro-batch's loss
    # is then its own mean, and their mean is the batch's
    schedule = ScheduleGPipe(stage, num_microbatches,
                             loss_fn=lambda out, t: loss_of(out, t, out.shape[0]))
    x, target = pipeline_batch()
    logs = [CollectiveLog(), CollectiveLog()]
    for log in logs:  # the first step also sends each stage's output shapes, once
        stage_module.zero_grad()
        with log:
            if rank == 0:
                schedule.step(x.to(device))
            elif rank == world_size - 1:
                schedule.step(target=target.to(device))
            else:
                schedule.step()
    whole = pipeline_model(0)
    loss_of(whole(x), target, PIPE_BATCH).backward()
    want = _flat(p.grad for p in stage_of(whole, rank, world_size).parameters())
    mine = _flat(p.grad.cpu() for p in stage_module.parameters())
    return {"first": logs[0].summary(), "collectives": logs[1].summary(),
            "grads_equal": case("g", mine, want, RTOL, ATOL).ok}


def torch_schedule_record(module: nn.Module, logs: list, rank: int, world_size: int) -> dict:
    """What one of torch's schedules did on this rank, over its steps (`logs`, one Ledger per
    step): the collectives of the first and of the last step, and whether this stage's
    gradients after the last step equal the unsplit model's on the same batch."""
    whole = pipeline_model(0)
    x, target = pipeline_batch()
    loss_of(whole(x), target, PIPE_BATCH).backward()
    want = _flat(p.grad for p in stage_of(whole, rank, world_size).parameters())
    mine = _flat(p.grad.cpu() for p in module.parameters())
    return {"first": logs[0].summary(), "collectives": logs[-1].summary(),
            "grads_equal": case("g", mine, want, RTOL, ATOL).ok}


def describe_torch_pipelining(records: list[dict]) -> str:
    """Per schedule the learner ran (`{name: torch_schedule_record}` from every rank): the
    gradient check and what each rank sent and received in the first and the second step."""
    if not records[0]:
        return pipelining_status()
    lines = []
    for name in records[0]:
        ok = "yes" if all(r[name]["grads_equal"] for r in records) else "NO"
        lines.append(f"{name}, 4 micro-batches: gradients equal the unsplit model's on every "
                     f"rank: {ok}")
        for rank, r in enumerate(records):
            lines.append(f"  rank {rank}: first step {_calls(r[name]['first'])}; second step "
                         f"{_calls(r[name]['collectives'])}")
    return "\n".join(lines)


def describe_torch_gpipe(records: list[dict | None]) -> str:
    """What torch's GPipe sent and received on each rank, and the gradient check."""
    if any(r is None for r in records):
        return f"not run: {pipelining_status()}"
    ok = "yes" if all(r["grads_equal"] for r in records) else "NO"
    lines = [f"ScheduleGPipe, 4 micro-batches: gradients equal the unsplit model's on every "
             f"rank: {ok}"]
    for rank, r in enumerate(records):
        lines.append(f"  rank {rank}: first step {_calls(r['first'])}; second step "
                     f"{_calls(r['collectives'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the exercises' checks

# (batch, hidden, out): 48 hidden features first, even over 2, 3 or 4 ranks, so that a wrong
# collective fails there on every rank alike (an all_gather of uneven shards would not match);
# then 7, which no world size from 2 to 6 divides.
ROW_CASES = ((8, 48, 16), (5, 7, 3))
# The check's output tolerance: each output is a sum of 48 products of unit normals (terms up to
# about 8 in all), which summed by rank, or by another CPU's kernels, lands up to a few 1e-6
# away near zero (1.8e-6 seen with ATEN_CPU_CAPABILITY=default, with 64). A wrong answer is off
# by O(1).
ROW_RTOL, ROW_ATOL = 1e-5, 1e-4


def _calls(summary: dict) -> str:
    return ", ".join(f"{op} x{c} of {b:,} B" for op, (c, b) in summary.items()) or "none"


def _raised(e: Exception) -> str:
    """An exception in a FAIL line: its type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _everyone_ok(ok: bool, device: torch.device | None) -> bool:
    """Whether every rank's cases so far passed (an all-reduce of a flag, outside any ledger):
    the ranks then stop, or go on, together. One rank alone going on to the next case would
    wait for ever in a collective the others never call."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class _CollectivesAutogradMisses(TorchDispatchMode):
    """Collectives whose gradient is not g's: called with grad mode on, on a tensor that
    requires a gradient (a bare dist.all_reduce of the product, or the functional one). Inside
    an autograd.Function's forward, grad mode is off, so g's all-reduce is not recorded.
    c10d's all_reduce_ has no autograd formula: torch's fallback passes the gradient through and
    warns that it "may lead to silently incorrect behavior"
    (torch/csrc/autograd/autograd_not_implemented_fallback.cpp); the functional all_reduce's
    formula differs by torch version (_unseen_text)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "namespace", "") in ("c10d", "_c10d_functional")
                and torch.is_grad_enabled()
                and any(isinstance(t, torch.Tensor) and t.requires_grad
                        for t in tree_leaves((args, kwargs)))):
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def functional_all_reduce_has_backward() -> bool:
    """Whether this torch gives the functional all_reduce an autograd formula (2.14.1 does:
    torch/distributed/_functional_collectives.py, all_reduce_backward, which all-reduces the
    gradient again; 2.9.1 has none)."""
    import torch.distributed._functional_collectives as funcol

    return hasattr(funcol, "all_reduce_backward")


def _unseen_text(op: str) -> str:
    """Why a collective run outside an autograd.Function is not g, for c10d's op or the
    functional one (whose formula this torch is asked for)."""
    if op in ("all_reduce", "all_reduce_"):  # _c10d_functional's names; c10d's is allreduce_
        formula = ("its backward all-reduces dL/dy again (N times the gradient)"
                   if functional_all_reduce_has_backward() else
                   "this torch has no autograd formula for it")
        return (f"your all_reduce is the functional collective: {formula}; g's backward is "
                "the identity, so put the sum in an autograd.Function")
    return (f"your {op} ran on a tensor that requires a gradient, outside an autograd.Function: "
            "autograd has no formula for c10d's collectives (torch's fallback passes the "
            "gradient through and warns that this may be silently incorrect); put the sum in "
            "an autograd.Function, g")


def _row_inputs(batch: int, hidden: int, out: int, rank: int, world_size: int, device):
    """The whole h, W, b and dL/dy of one case (the same on every rank: a fixed seed), and
    this rank's shards of h and W as leaves that want gradients, with a leaf copy of b."""
    g = torch.Generator().manual_seed(100 + hidden)
    h, w, b, dy = (torch.randn(*shape, generator=g) for shape in
                   ((batch, hidden), (out, hidden), (out,), (batch, out)))
    mine = [t.tensor_split(world_size, dim=1)[rank].clone().to(device).requires_grad_()
            for t in (h, w)] + [b.clone().to(device).requires_grad_()]
    return (h, w, b, dy), mine


def _row_grads(label: str, mine: list, whole: tuple, rank: int, world_size: int) -> list[Case]:
    """This rank's gradients against the unsplit layer's: its columns of dL/dh and dL/dW, and
    the whole dL/db (a replicated parameter: every rank's copy must get all of it)."""
    h, w, _, dy = whole
    want = [(dy @ w).tensor_split(world_size, dim=1)[rank],
            (dy.T @ h).tensor_split(world_size, dim=1)[rank], dy.sum(0)]
    return [Case(f"{label}: the gradient of {name}", False, "got None: no gradient reaches it "
                 "(a .detach(), torch.no_grad(), or a rank that does not use it), so it "
                 "cannot train") if t.grad is None else
            case(f"{label}: the gradient of {name}", t.grad, ref, ROW_RTOL, ROW_ATOL)
            for name, t, ref in zip(("h_shard", "weight_shard", "bias"), mine, want)]


def _row_case(fn, batch: int, hidden: int, out: int, device) -> list[Case]:
    """One case on this rank: the output, the forward's collectives, then backward from the
    same dL/dy on every rank: no collective (g passes it through), no collective autograd
    cannot see, and the gradients of the unsplit layer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole, mine = _row_inputs(batch, hidden, out, rank, world_size, device)
    h, w, b, dy = whole
    label = f"batch {batch}, {hidden} hidden features over {world_size} ranks"
    with CollectiveLog() as log, _CollectivesAutogradMisses() as unseen:
        y = fn(*mine)  # (raised on one rank alone, the others wait in their collective: the
    cases = [case(f"{label}: the output", y, h @ w.T + b, ROW_RTOL, ROW_ATOL)]  # kit names it)
    want = [("all_reduce", batch * out * 4)]
    got = [(c.op, c.nbytes) for c in log.calls]
    cases.append(Case(f"{label}: the collectives", got == want, "" if got == want else
                      f"got {', '.join(c.text() for c in log.calls) or 'none'}, expected "
                      f"one all_reduce of the output's {batch * out * 4} B"))
    if not isinstance(y, torch.Tensor) or y.grad_fn is None:
        return cases + [Case(f"{label}: the output carries a gradient", False,
                             "it has no grad_fn (.detach() or torch.no_grad() cut autograd "
                             "off): backward cannot reach the weight, so the layer cannot "
                             "train")]
    with CollectiveLog() as back:
        y.backward(dy.to(device))
    cases.append(Case(f"{label}: a sum autograd knows how to differentiate", not unseen.ops,
                      "" if not unseen.ops else
                      _unseen_text(unseen.ops[0])))
    cases.append(Case(f"{label}: backward's collectives", not back.calls,
                      "" if not back.calls else
                      f"got {', '.join(c.text() for c in back.calls)}, expected none: every "
                      "rank already holds the whole dL/dy"))
    return cases + _row_grads(label, mine, whole, rank, world_size)


@exercise_check("row_parallel", "ranks")
def check_row_parallel(namespace: dict) -> list[Case]:
    """row_parallel_forward on this rank's columns (48 hidden features, then 7, which no world
    size above 1 divides): the whole output on every rank, exactly one all-reduce of the
    output's bytes in forward, recorded by the Ledger where torch dispatches collectives (an
    import alias counts the same; an all_gather or a gather to rank 0 is named); and it must
    train: backward from dL/dy gives this rank's share of the unsplit layer's gradients, with
    no collective, and not through a collective autograd cannot see (a bare all_reduce).
    The world size and rank are torch's, so the check holds at any world size."""
    fn = require(namespace, "row_parallel_forward")
    device = namespace.get("device")
    cases: list[Case] = []
    for batch, hidden, out in ROW_CASES:
        cases += _row_case(fn, batch, hidden, out, device)
        if not _everyone_ok(all(c.ok for c in cases), device):
            break  # a wrong collective could stall on the next case's uneven shards
    return cases


ORDER_CASES = ((2, 4), (2, 1), (3, 5), (4, 2), (4, 8), (1, 3))  # (stages, micro-batches)
RUN_MICROBATCHES = 5  # the step run on the ranks: more than 2 or 3 stages, and 16 = 4 + 3 x 4


def _first_difference(got: list, want: list) -> str:
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"at position {k}: got {a}, expected {b}"
    return f"{len(got)} ops, expected {len(want)}"


def _as_order(got):
    """A learner's order as a list of (kind, i) tuples: any iterable of pairs (a generator, a
    tuple, lists for pairs) is the same answer; anything else is returned as it is."""
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        return got
    got = list(got)
    return [tuple(op) if isinstance(op, (list, tuple)) else op for op in got]


def _messages(order: list[tuple[str, int]], stage: int, num_stages: int) -> list[tuple]:
    """The sends and receives a stage makes running `order` (as run_stage does): a forward
    receives from the stage before and sends to the one after; a backward receives from the
    stage after and sends to the one before. [(op, peer, what for)], in order."""
    out = []
    for kind, i in order:
        what = f"{'forward' if kind == 'F' else 'backward'} of micro-batch {i}"
        src, dst = (stage - 1, stage + 1) if kind == "F" else (stage + 1, stage - 1)
        if 0 <= src < num_stages:
            out.append(("recv", src, what))
        if 0 <= dst < num_stages:
            out.append(("send", dst, what))
    return out


def _messages_case(label: str, calls: list, want: list[tuple]) -> Case:
    """The sends and receives the Ledger saw on this rank against those of 1F1B's order; a
    failure names the first call that differs and what 1F1B does there."""
    for k, (c, w) in enumerate(zip(calls, want)):
        if (c.op, c.peer) != w[:2]:
            return Case(label, False, f"call {k + 1}: got {c.text()}, expected {w[0]} "
                                      f"{'to' if w[0] == 'send' else 'from'} rank {w[1]} "
                                      f"({w[2]})")
    ok = len(calls) == len(want)
    return Case(label, ok, "" if ok else f"{len(calls)} sends and receives, expected "
                                         f"{len(want)}")


def _agreed_orders(fn, world_size: int) -> tuple[list | None, str]:
    """Every stage's order for the step on the ranks, if every rank's function gave the same
    orders and they form a schedule that cannot deadlock; else None and why. Every rank
    reaches the all_gather, even if the function raised, so all decide alike."""
    try:
        mine = [_as_order(fn(s, world_size, RUN_MICROBATCHES)) for s in range(world_size)]
        simulate(mine)
        reason = ""
    except Exception as e:  # noqa: BLE001 - a wrong order is a failed case, not a crash
        mine, reason = None, _raised(e)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (mine, reason))
    if any(r for _, r in everyone):
        return None, next(r for _, r in everyone if r)
    if any(o != everyone[0][0] for o, _ in everyone):
        return None, "the ranks' functions gave different orders (use `stage`, not the rank)"
    return mine, ""


def _order_cases(fn, kit) -> list[Case]:
    """The learner's order against 1F1B's for every stage of each (p, m) in ORDER_CASES."""
    cases = []
    for p, m in ORDER_CASES:
        for s in range(p):
            got, want = _as_order(fn(s, p, m)), kit(s, p, m)
            ok = got == want
            cases.append(Case(f"stage {s} of {p}, {m} micro-batches", ok, "" if ok else
                              _first_difference(got, want) if isinstance(got, list) else
                              f"got {got!r}, expected a list like {want[:3]}"))
    return cases


@exercise_check("one_f_one_b", "ranks")
def check_one_f_one_b(namespace: dict) -> list[Case]:
    """A step of the pipeline run on these ranks in the learner's order (5 uneven micro-batches,
    more than the stages), where it is a schedule that cannot deadlock: each rank's sends and
    receives, recorded by the Ledger in order with their peers, are 1F1B's (GPipe's order gives
    the same gradients and FAILs here), the gradients equal the unsplit model's, and the stage
    holds min(p - s, m) micro-batches at most. Then the order itself against 1F1B's for 1 to 4
    stages and 1 to 8 micro-batches (fewer micro-batches than stages too), on the last rank
    only (every rank would find the same), so that a FAIL names the run's cases first."""
    fn = require(namespace, "one_f_one_b")
    kit = solution_module("one_f_one_b").one_f_one_b
    rank, world_size = dist.get_rank(), dist.get_world_size()  # any world size the check runs at
    device = namespace.get("device")
    m = RUN_MICROBATCHES
    sizes = ", ".join(str(len(t)) for t in torch.arange(PIPE_BATCH).tensor_split(m))
    label = f"a step on {world_size} ranks, {m} micro-batches of {sizes}"
    orders, why = _agreed_orders(fn, world_size)
    if orders is None:
        cases = [Case(f"{label}: your orders", False, f"not run: {why}")]
    else:
        run = run_pipeline("1f1b", m, rank, world_size,
                           {"one_f_one_b": lambda s, p, n: orders[s]}, device=device)
        cases = [_messages_case(f"{label}: stage {rank}'s sends and receives, in order",
                                run["calls"], _messages(kit(rank, world_size, m), rank,
                                                        world_size)),
                 Case(f"{label}: gradients equal the unsplit model's", run["grads_equal"],
                      "" if run["grads_equal"] else "they differ")]
        held, bound = peak_in_flight(run["order"]), min(world_size - rank, m)
        cases.append(Case(f"{label}: micro-batches held at once on stage {rank}",
                          held == bound, "" if held == bound else f"got {held}, expected {bound}"))
    return cases + (_order_cases(fn, kit) if rank == world_size - 1 else [])


BUBBLE_CASES = ((2, 1), (2, 4), (2, 8), (3, 5), (4, 4), (4, 16), (1, 6), (8, 2))


def _wrong_bubble(p, m):
    return (p - 1) / m  # idle slots over busy ones, not over the whole step


def _other_definition(fn: Callable) -> str:
    """A note where the answer is, on every case, the bubble over the ideal time, (p - 1)/m:
    the definition of Narayanan et al. (SC21) and the Ultra-Scale Playbook, right there but
    not the one asked for here."""
    try:
        same = all(abs(float(fn(p, m)) - (p - 1) / m) <= 1e-9 for p, m in BUBBLE_CASES)
    except Exception:  # noqa: BLE001 - no note for an answer that raises or is no number
        same = False
    return (" (yours is (p - 1)/m, the idle time over the ideal time 2m, as Narayanan et al. "
            "and the Ultra-Scale Playbook define the bubble; this exercise asks for the idle "
            "fraction of the whole step, 2(m + p - 1) slots)") if same else ""


def _number(x) -> float | None:
    """A predicted value as a float (an int, a Fraction, a numpy or 0-d torch number alike);
    None if it is no number."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


@exercise_check("bubble_fraction", "prediction", wrong_answer=_wrong_bubble)
def check_bubble_fraction(answer) -> list[Case]:
    """bubble_fraction(p, m) against the bubble counted in slots of GPipe's schedule, for
    several p and m (fewer micro-batches than stages too, and one stage): any number type
    that equals it within 1e-9 (a Fraction, an int 0 for one stage) is the same answer."""
    if not callable(answer):
        return [Case("the answer", False, f"got {answer!r}, expected the function "
                                          "bubble_fraction(p, m)")]
    fn = require({"bubble_fraction": answer}, "bubble_fraction")
    note, cases = _other_definition(fn), []
    for p, m in BUBBLE_CASES:
        want = bubble_from_slots(simulate([gpipe(s, p, m) for s in range(p)]))
        got = fn(p, m)
        value = _number(got)
        if value is None:
            cases.append(Case(f"p={p}, m={m}", False, f"got {got!r}, expected a number "
                                                      f"such as {want:.6g}"))
        else:
            ok = abs(value - want) <= 1e-9
            cases.append(Case(f"p={p}, m={m}", ok, "" if ok else
                              f"got {value:.6g}, expected {want:.6g}"
                              f"{note}"))
    return cases
