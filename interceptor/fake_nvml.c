/* Placeholder until the fake NVML lands: exports nothing yet. */
