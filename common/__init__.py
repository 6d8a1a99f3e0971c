"""tandem: common package."""
