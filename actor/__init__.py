"""tandem: actor package."""
