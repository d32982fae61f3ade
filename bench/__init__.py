"""`kiln bench`: kiln against transformers baselines on one deterministic workload."""
