"""Imported as ``kiln.builder`` (folder ``builder_job/``, named for the Job that runs it): the kiln build
pipeline (`kiln build`), one module per stage in ``stages/``."""
