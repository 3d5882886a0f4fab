"""Example training jobs that run under trainguard."""
