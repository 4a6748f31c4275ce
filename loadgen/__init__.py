"""Trace replay, open-loop load generation and the run report (DESIGN.md sections 7 and 8).

- :mod:`.trace`: read a trace in the Azure Functions 2019 format (``read_trace``; the bundled
  sample is ``default_trace_dir()``).
- :mod:`.arrivals`: the seeded replay plan (``plan_replay``): K busiest functions of the span,
  exact per-minute counts, arrivals drawn within each minute, one ``Invocation`` per request.
- :mod:`.assign`: the seeded rule giving each function a model (``assign_models``).
- :mod:`.generator`: the open-loop generator (``OpenLoopGenerator``) over any async
  ``invoke(inv) -> Outcome``; :mod:`.clock` holds its clocks, including virtual time.
- :mod:`.report`: the report (``build_report``, ``render``, ``render_compare``).

A replay, wired end to end::

    plan = plan_replay(read_trace(trace_dir), seed=seed, duration_s=120, speedup=10, functions=16)
    models = assign_models(plan.functions, seed, plan.speedup, capacity_rps)
    gen = OpenLoopGenerator(invoke, progress=True)        # invoke: e.g. a NATS request
    result = await gen.run(plan.invocations, duration_s=plan.duration_s)
    meta = {f.name: FunctionMeta(model=models[f.name], slo_ms=slo_ms(models[f.name])) for f in plan.functions}
    report = build_report(result.records, meta, run_facts, run_info(plan, result, policy="dilu"))
    render(report, console)
"""
