"""The model worker: downloads weights, loads the pipeline, pulls its model's queue and publishes replies."""
