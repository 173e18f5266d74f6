"""Runs the analytics views of the inference log and prints them as tables: `python -m analytics`."""
