"""The horizontal scaler: adds and retires function instances from burst windows (Knative KPA
semantics), lazily behind vertical headroom, with hybrid-histogram keep-alive and pre-warm."""
