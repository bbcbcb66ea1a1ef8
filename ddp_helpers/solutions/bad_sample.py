"""Solution (lesson 12, bug 5): the loss is not finite on rank 1 only, at step 3, and row 0 of
its batch holds the NaN: rank 1's shard is x[1::2], so its sample 2 * 3 + 0 = 6 is the dataset's
1 + 2 * 6 = 13."""

answer = 13
