"""A run's bookkeeping: the entry helper every process starts with, whose output directory it is,
checkpoints and their retention, and directories built once.
"""
