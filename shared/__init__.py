"""echo2 shared package."""
