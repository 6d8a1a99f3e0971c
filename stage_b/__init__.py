"""tandem: stage_b package."""
