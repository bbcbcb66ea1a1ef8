"""Prediction (lesson 10): DDP's all-reduces per step, after the first, for bucket_cap_mb 0.05,
0.1 and 25 on the lesson's model (gradients: the first layer 16.5 KiB, three blocks of 64.5 KiB,
the last layer 5 KiB; 215 KiB in all)."""

# DDP fills a bucket with gradients in reverse parameter order and closes it as soon as it holds
# at least the cap (lesson 09's make_buckets); one all-reduce per bucket:
#   0.05 MiB = 51.2 KiB: [last layer + block 3] (69.5), [block 2], [block 1], [first layer] -> 4
#   0.1 MiB = 102.4 KiB: [last layer + blocks 3 and 2] (134), [block 1 + first layer] (81) -> 2
#   25 MiB: everything in one bucket -> 1
answer = [4, 2, 1]
