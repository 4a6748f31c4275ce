"""``dilu sim``: a discrete-event simulator of N nodes x G GPUs that drives the live policy objects
(profiler search, scheduler placement, vertical and horizontal scalers) over the real traces.

- :mod:`.engine`: the event loop (a heap of (time ms, seq, callback, argument));
- :mod:`.node`: GPUs and instances: queues, batches, pacing to the grant, interference;
- :mod:`.run`: wiring the policies, the trace and the model surfaces into a run, and its Report;
- :mod:`.workload`: the paper's scheduling workloads through the placement policy;
- :mod:`.plots`: PNG plots of runs (matplotlib).
"""
