"""The wire contract shared by the API server and the model worker; neither imports the other."""
