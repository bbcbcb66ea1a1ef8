"""Per-rank functions, one module per notebook: importable, because spawned ranks import them."""
