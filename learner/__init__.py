"""tandem: learner package."""
