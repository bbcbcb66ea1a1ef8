"""Prediction (lesson 06): all-reduce calls of average_parameters, every 5 of 100 steps."""

# 100 / 5 = 20 averages. average_parameters makes one call per parameter tensor: the seed model
# has 2 (the weight and the bias of Linear(784, 10)), the MLP 784-64-10 has 4 (two layers, each
# a weight and a bias). Flattening them into one buffer first would make it 20 calls for both.
answer = (20 * 2, 20 * 4)
