"""The API process: the app factory, the ASGI/WSGI bridge and gunicorn settings, auth, errors, the OpenAPI
document, readiness, metrics, and the one app-state object that holds every long-lived collaborator."""
