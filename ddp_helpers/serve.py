"""`python -m ddp_helpers.serve --connect HOST:PORT --token-file PATH`: the worker torchrun (or
srun) runs for a notebook's `%ranks listen N`; it attaches to the notebook and serves its
`%%ranks` cells. The rank side lives in the engine (engine/rank/serve.py)."""

from .engine import serve_main

if __name__ == "__main__":
    serve_main()
