"""Plain PyTorch implementations of every titan op, computed in float32.

They are the ground truth for tests (besides float64 formulas in the tests themselves) and the
fallback backend on any device. One module per op family.
"""
