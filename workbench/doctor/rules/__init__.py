"""The rules: one module per kind of hazard. Each decides from what the intake recorded (and what
the probes measured) whether there is a finding, and builds it with its evidence and cause."""
