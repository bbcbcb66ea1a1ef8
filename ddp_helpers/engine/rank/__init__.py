"""The rank side: what runs inside every rank, whoever started it.

`entry` starts a rank the kit forked (its pipes, environment and lifeline) and runs a launched
function or the cell server; `serve` is what torchrun or srun runs for a notebook's `%ranks
listen` (it attaches over a socket); both serve cells with `cells` over a `link` (pipes or the
socket), and answer "where are you?" from `stacks`. Preloaded by the start server, so it
imports only the wire, the foundation (runtime, ledger) and torch, never the learner's code.
"""
