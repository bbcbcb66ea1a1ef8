"""Solution (lesson 12, bug 8): one order, three times: without set_epoch the sampler's epoch
stays 0, and it shuffles with seed + epoch."""

answer = 1
