"""Imported as ``kiln.operator`` (folder ``operator/``; the import name keeps it from shadowing the
standard library's ``operator``): the kiln operator: kopf handlers and pure renderers of Jobs,
Deployments, Services."""
