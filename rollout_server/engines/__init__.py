"""tandem: rollout_server/engines package."""
