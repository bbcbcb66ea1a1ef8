"""Exercise solutions; `dh.exercise(name)` falls back to these, `dh.reveal(name)` prints them."""
