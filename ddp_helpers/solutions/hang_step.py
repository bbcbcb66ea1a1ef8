"""Solution (lesson 12, bug 1): rank 0 waits in the all-reduce of the first step that logs,
step 4 (step % 5 == 4); the snapshot after the stop shows `step = 4` in report_loss's frame."""

answer = 4
