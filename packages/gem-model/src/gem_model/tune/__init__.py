"""``gem-train tune``: short real runs over a small space, from the config (:mod:`.search`)."""
