"""Blueprints by resource: predict, models, health."""
