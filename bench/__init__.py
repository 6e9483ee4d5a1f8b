"""zeroshard benchmarks: ``python -m bench [suite ...] [--quick] [--out DIR]``.

Benchmarks measure; tests assert. Every figure is a ratio against a baseline measured in the same
run, or a fraction of a formula computed for the same model. See docs/benchmarks.md.
"""
