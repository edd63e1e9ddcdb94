"""One unit of training (``loop``) or a recipe's own loop (``own_loop``): the live session, the state a unit saves
and restores, RNG, evaluation, FSDP, and what outlives a unit in a process (``warm``)."""
