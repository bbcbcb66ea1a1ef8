"""Solution (lesson 12, bug 2): rank 1's counts are int64[9] against rank 0's int64[10], and
torch.bincount's length is the largest label plus one: rank 1 never has label 9."""

answer = 9
