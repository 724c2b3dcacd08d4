"""Sizes and plans: the per-layer profile (profiler.py), the memory and time model of a
plan (memory_model.py), the dynamic programs over it (solver.py), Plan, plan(),
balanced() and predict() (plans.py), and estimate() on meta tensors (estimate.py).
"""
