"""How a state becomes a committed checkpoint folder. Follow one from the training thread to the store:

1. ``snapshots.py``: ``SnapshotPipeline.take`` copies the state into a slot (the whole stall; the slots are the
   host-memory tier's, checkpointing/host_tier/), a publish thread checksums it and writes its record, an upload
   thread hands the newest to ``committer.finish``; a state the slots cannot hold (a sparse tensor) is serialized on
   the training thread and ``submit``ted to the same upload thread: one thread commits in the background, in order;
2. ``committer.py``: the request types (``CommitTerms``, ``CommitRequest``, ``PendingCommit``), the ``Committer``
   that commits a state now or hands it to the pipeline, and ``finish``, the one end of
   every commit: files -> manifest -> ``latest`` (fenced, retried), then superseded snapshots deleted, then retention;
3. ``streaming.py``: each file ``torch.save``d straight into the store while it is hashed, then
   ``CheckpointStore.begin_commit`` / ``commit_files`` write the manifest and move ``latest``;
4. ``sharded.py`` (with ``dcp_metadata.py``): FSDP's DCP shards, written by every rank and committed by rank 0 under
   the same manifest and ``latest``, and read back;
5. ``agent.py``: the checkpoint agent, a process of its own that commits the newest published slot through
   ``finish`` when the training process dies without closing its run (a relaunch elsewhere then loses one step).
"""
