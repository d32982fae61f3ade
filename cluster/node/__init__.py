"""The node agent (``python -m kiln_cluster.node``): the one stand-in of the local cluster, in place of the
kubelet and a container runtime. It runs each pod bound to its Node as local processes."""
