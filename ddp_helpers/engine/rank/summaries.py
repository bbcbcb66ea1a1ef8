"""What `pool.compare` asks of each rank: the named values, flattened into leaves (a module
into its state_dict, an optimizer into its state and hyperparameters, lists and dicts into
their items), each leaf summarised so that the parent can tell ranks apart: a digest that is
equal on two ranks exactly when their bytes are, and the tensor itself when it is small."""

from __future__ import annotations

import hashlib

import torch

from ..wire.messages import CHUNK, Summary

_SMALL = 4 * CHUNK  # tensors up to this many elements travel whole
_MAX_LEAVES = 2000


def summaries(namespace: dict, expressions: tuple[str, ...],
              chunk: tuple[str, int] | None = None) -> dict[str, list[Summary]]:
    """{expression: [Summary, ...]} for each expression evaluated in `namespace`; with
    `chunk` (leaf, k), only that leaf's k-th chunk of values."""
    out = {}
    for expression in expressions:
        try:
            value = eval(expression, namespace)  # noqa: S307 - the learner's own expression
        except Exception as e:  # noqa: BLE001 - say what went wrong for this name only
            out[expression] = [Summary(expression, "missing", text=f"{type(e).__name__}: {e}")]
            continue
        leaves = list(_leaves(expression, value))[:_MAX_LEAVES]
        if chunk is not None:
            t = dict(leaves)[chunk[0]]
            flat = _flat(t)
            out[expression] = [Summary(chunk[0], "tensor", values=flat[chunk[1] * CHUNK:
                                                                    (chunk[1] + 1) * CHUNK])]
            continue
        out[expression] = [_summary(name, v) for name, v in leaves]
    return out


def _leaves(name: str, value):
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, torch.nn.Module):
        for key, v in value.state_dict().items():
            yield f"{name}.{key}", v
    elif isinstance(value, torch.optim.Optimizer):
        state = value.state_dict()
        for index, entries in state["state"].items():
            for key, v in entries.items():
                yield f"{name}.state[{index}].{key}", v
        for i, group in enumerate(state["param_groups"]):
            for key, v in group.items():
                if key != "params":
                    yield f"{name}.param_groups[{i}].{key}", v
    elif isinstance(value, dict):
        for key, v in value.items():
            yield from _leaves(f"{name}[{key!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}[{i}]", v)
    else:
        yield name, value


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1)


def _summary(name: str, value) -> Summary:
    if not isinstance(value, torch.Tensor):
        text = repr(value)
        return Summary(name, "value", dtype=type(value).__name__,
                       digest=hashlib.sha1(text.encode()).hexdigest()[:8], text=text[:80])
    flat = _flat(value)
    dtype = str(value.dtype).removeprefix("torch.")
    shape = tuple(value.shape)
    raw = _bytes(flat)
    digest = hashlib.sha1(f"{dtype}{shape}".encode() + raw).hexdigest()[:8]
    if flat.numel() <= _SMALL:
        return Summary(name, "tensor", dtype, shape, digest, values=flat)
    size = CHUNK * flat.element_size()
    chunks = tuple(hashlib.sha1(raw[i:i + size]).hexdigest()[:8] for i in range(0, len(raw), size))
    return Summary(name, "tensor", dtype, shape, digest, chunk_digests=chunks)


def _bytes(flat: torch.Tensor) -> bytes:
    """The tensor's bytes, for any dtype (numpy has no bfloat16: view them as bytes first)."""
    if flat.numel() == 0:
        return b""
    return flat.contiguous().view(torch.uint8).numpy().tobytes()
