"""Evaluation: are the calibrated estimates right (metrics, plots), and what do they buy at serve
time (a replay of serving policies through the serve-time allocator, on verify-cost curves)?

Modules: ``metrics`` (ECE family, Brier, NLL, AUROC, accepted-length error), ``data`` (banks as
per-round arrays + n-gram feature tensors), ``calibration`` (slices), ``cost`` (verify-cost
curves), ``replay`` (goodput of the policies in :mod:`calib.policies`), ``plots``, ``report`` (metrics.json, report.md), ``run``
(what ``eval.py`` calls).
"""
