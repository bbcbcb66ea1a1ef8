"""Prediction (lesson 00): every rank contributes rank + 1, so after all_reduce (SUM) on three
ranks each holds 1 + 2 + 3."""

answer = 6.0
