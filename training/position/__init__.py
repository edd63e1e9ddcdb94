"""The data position: the seeded sample order and the progress counters in samples, which survive any change of
batch size or world size (docs/data-position.md)."""
