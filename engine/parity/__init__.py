"""Parity: what "the same" means (compare.py), the one-device reference step
(reference.py), the divergence localizer (localize.py), golden trajectories
(trajectory.py) and the report text (report.py)."""
