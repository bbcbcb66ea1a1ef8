"""Solution (lesson 12, bug 4): rank 0 (5 of the 9 samples: 3 batches of 2, against rank 1's 2)
is in a third all-reduce while rank 1 has left the loop for the barrier."""

answer = 0
