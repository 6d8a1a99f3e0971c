"""A torchrun process group seen from one rank (the learner's and Stage-B's ranks).
"""
