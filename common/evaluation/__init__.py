"""Detector quality: the evaluation loop shared by the evaluator and the learner, its metrics
(P/R/F1, COCO mAP, LVIS federated AP) and how sure they are (bootstrap and seed intervals).
"""
