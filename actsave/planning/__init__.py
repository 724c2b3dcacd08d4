"""Sizes and plans: the per-layer profile, the memory model and its solvers
(planning/planner.py), and estimate() on meta tensors (estimate.py).
"""
