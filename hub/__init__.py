"""echo2 hub package."""
