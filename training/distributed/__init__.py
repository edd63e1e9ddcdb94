"""Ranks and machines: the gang of torchrun ranks kept across units (``gang``, ``rank``), training across nodes
(``nodes``, ``node_run``), child processes that die with their parent, and errors carried across the process
boundary."""
