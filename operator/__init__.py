"""The kiln operator: kopf handlers and pure renderers of Jobs, Deployments, Services."""
