"""The local stand-ins for Google Cloud, and the launcher that runs the whole stack on one machine."""
