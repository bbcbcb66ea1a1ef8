"""Solution (lesson 12, bug 7): every parameter agrees (the gradients are averaged), but
BatchNorm's running statistics, buffers that no collective touches, do not."""

answer = "model.1.running_mean"
