"""The rules: one module per kind of hazard. Each decides from what the intake recorded (and what
the probes measured) whether there is a finding, and builds it with its evidence and cause."""


def where(doctor) -> str:
    """The phase an op runs in, a capture by its graph's name (for the evidence)."""
    return doctor.capturing.name if doctor.phase == "capture" and doctor.capturing else doctor.phase
