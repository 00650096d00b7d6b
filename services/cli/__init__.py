"""The ``longspark`` command line (``services.cli.main:main``)."""
