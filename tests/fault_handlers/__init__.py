"""Handler modules that misbehave, for the node agent's fault tests (tests/integration/test_lifecycle_faults.py).
The agent's instances import them with tests/ on PYTHONPATH."""
