"""clef-serve: the System One HTTP service over clef_cuda (app.server builds it from the routers in app/routes; the
command line is app.cli). docs/development.md maps the rest."""
