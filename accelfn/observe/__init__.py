"""Measurement and diagnosis: monitor, GPU sampler, diagnostics, sync probe, profiler, doctor."""
