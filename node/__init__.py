"""echo2 node package."""
