"""Everything before a run's first step: pre-flight checks, the run's identity, ``autoresume``/overwrite,
``resume_from`` roll-backs and the warm start from ``load_path`` with what a checkpoint may carry into a run."""
