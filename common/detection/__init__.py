"""The detection domain: the answer format, the coord tokens, strict parsing of a rollout, Hungarian
matching to ground truth and the teacher-forced targets built from a match.
"""
