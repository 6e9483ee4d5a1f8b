"""``offload="cpu"``: the host update pipeline, the measured GPU margin and the chunks placed in it."""
