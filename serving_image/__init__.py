"""Imported as ``kiln.serving`` (folder ``serving_image/``, named for the image it ships as): the
OpenAI-compatible HTTP server around the kiln runtime (`kiln serve`) and the serving Dockerfile."""
