"""clef-serve: the System One HTTP service over clef_cuda (routes in app.server, CLI in app.cli)."""
