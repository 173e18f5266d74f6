"""gunicorn's entry point: `gunicorn --config api_server/gunicorn_conf.py api_server.wsgi:app`.

Imported in each gunicorn worker after it forks (no preload), so Google clients are created post-fork.
"""

from api_server.app import create_app
from contract.jsonlog import configure_logging

configure_logging()
app = create_app()
