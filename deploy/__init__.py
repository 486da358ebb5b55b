"""Shipping a draft: the `draftsmith` command, export of a draft+target bundle that engines load as is, the engines' losslessness judge, and the benchmarks."""
