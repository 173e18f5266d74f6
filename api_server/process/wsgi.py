"""The Flask app, built once per gunicorn worker; `api_server/process/asgi.py` serves it (gunicorn's asyncio worker).

Imported in each gunicorn worker after it forks (no preload), so Google clients are created post-fork.
"""

from api_server.process.app import create_app
from contract.jsonlog import configure_logging

configure_logging()
app = create_app()
