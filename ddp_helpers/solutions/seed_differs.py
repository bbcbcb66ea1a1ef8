"""Solution (lesson 12, bug 6): the model's weights (and bias) differ across ranks, drawn after
torch.manual_seed(rank); the data differs too, as it should."""

answer = "the model's weights"
