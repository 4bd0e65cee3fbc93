"""What the tests share: fixtures, workers of multi-process tests, the float64 oracles, and the
GPU smoke cases. Test files stay at the top of tests/."""
