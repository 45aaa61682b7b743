"""How long a replicated job pauses when a server dies (benchmarks/failover/run.py)."""
