"""The vertical scaler: one per node; turns telemetry and kernel-cycle stretch into TokenGrants."""
