"""tandem: rollout_server package."""
