"""Recipes: learning-rate schedules, parameter groups, early stopping, memory format."""
