"""beamflow's public PTransforms, one per module."""
