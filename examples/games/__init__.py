"""A text game environment and a user-simulator interaction, plugged in by name."""
