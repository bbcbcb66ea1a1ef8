"""Solution (lesson 04): which ranks rank 0's monitored_barrier names when ranks 1 and 2 of three
never arrive, keyed by wait_all_ranks.

Rank 0 waits for ranks 1, 2, ... in order. With wait_all_ranks=False it raises at the first rank
that misses the timeout, so its error names rank 1 only (fail fast); with wait_all_ranks=True it
waits for every rank and names all that failed. Ranks 1 and 2 themselves are not in the barrier
at all here; had rank 2 called it, it would have failed too, waiting for rank 0's release.
"""

answer = {True: [1, 2], False: [1]}
