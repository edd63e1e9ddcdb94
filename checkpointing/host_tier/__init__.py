"""The host-memory tier: a run's newest snapshots kept in this machine's shared memory, so that a relaunch here after a
hard kill resumes from one step ago. Read in this order:

- ``cap.py``: how many bytes one user's snapshots may hold (``TRAIN_HOST_TIER_MAX_BYTES``), checked under one lock;
- ``tier.py``: ``HostTier``, a run's folder of slots (the snapshot buffers), records and checksums;
- ``gc.py``: folders whose run is gone, found under their ``flock`` and removed (``python -m checkpointing gc``).

The commit wing (checkpointing/commit/snapshots.py) fills the slots and uploads them; nothing here knows training.
"""
