"""Prediction (lesson 05): lines the listing's per-batch print makes in one epoch on 4 ranks."""

# Without the sampler each rank walks all 60,000 images: ceil(60000 / 64) = 938 batches, and
# prints a line for each, so 4 ranks print 4 x 938. With the sampler each rank gets
# ceil(60000 / 4) = 15,000 images: ceil(15000 / 64) = 235 batches, 4 x 235 lines.
answer = (4 * 938, 4 * 235)
