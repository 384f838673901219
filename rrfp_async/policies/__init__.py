"""Hints (schedule orders) and policies (coroutines that pick among ready tasks)."""
