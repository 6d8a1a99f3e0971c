"""The standalone evaluator: greedy rollouts of a validation JSONL through a rollout server, scored
with ``common.evaluation.loop`` and drawn on the images (``python -m evaluator --help``; docs/evaluation.md)."""
