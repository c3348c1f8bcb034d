"""Experiments across lineages: seed sweeps, the asynchronous split, the statistics and reports
that compare arms, and the Theorem 4.5 advisor.
"""
