"""Shared statistical helpers for the exactness tests: the same chi-square that judges engines."""

from train.conformance import chi2_pvalue  # noqa: F401
