"""Solution (lesson 12, bug 3): each element of the two-rank update is twice the one-process
update: the gradients were summed over the 2 ranks and never divided by the world size."""

answer = 2
