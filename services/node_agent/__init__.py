"""The node agent: instances, control blocks, telemetry, grants, profiling trials."""
