"""The zoo (registry filled in below)."""
