"""tandem launcher: start and supervise the whole topology from one config."""
